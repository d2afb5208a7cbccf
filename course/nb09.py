"""Notebook 09's measuring machinery (reuse and rollback): a multi-turn chat with and without the
prefix cache, the hit rate of a request mix, prompt lookup against plain greedy, each timed in
interleaved rounds (medians and spreads), and the figure that answers the notebook's question.

Each public function is one notebook cell: it measures, returns its numbers and prints one line.
"""

import random
import statistics
import time

import torch
from matplotlib.figure import Figure

from kvlib import generate
from kvlib.decoder import forward
from kvlib.paged_cache import BlockPool, PagedCache

from . import plots

BLOCK = 16  # slots per block, vLLM's default


def chat_ids(tok, messages, device) -> torch.Tensor:
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"].to(device)


def conversation(model, tok, system: str, questions: list[str], new_tokens: int) -> list:
    """Each turn's prompt ``[1, n]``: the system prompt, then every earlier question with the
    model's greedy answer, then the new question, as a chat client resends it."""
    messages, prompts = [{"role": "system", "content": system}], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        prompts.append(chat_ids(tok, messages, model.device))
        answer = generate(model, prompts[-1], new_tokens).tokens
        messages.append({"role": "assistant",
                         "content": tok.decode(answer, skip_special_tokens=True)})
    return prompts


def _pool(model, prompts, new_tokens: int, prefix_cache: bool) -> BlockPool:
    """Room for every turn at once, so nothing cached is evicted in the chat."""
    blocks = sum(-(-(p.shape[1] + new_tokens) // BLOCK) for p in prompts)
    return BlockPool.for_model(model.config, blocks, BLOCK, device=model.device, dtype=model.dtype,
                               prefix_cache=prefix_cache)


def _chat_once(model, prompts, new_tokens: int, prefix_cache: bool) -> list[tuple]:
    """The turns on a fresh pool: per turn ``(tokens computed, seconds to first token, tokens)``.
    The first token is a request of its own (the lookup, the prefill, the pick: all of it timed);
    the answer then continues on the same cache, and its full blocks are cached with it."""
    pool = _pool(model, prompts, new_tokens, prefix_cache)
    eos = model.generation_config.eos_token_id
    rows = []
    for ids in prompts:
        cache = PagedCache(pool)
        start = time.perf_counter()
        first = generate(model, ids, 1, cache=cache)  # .tokens is on the host: the time is done
        ttft = time.perf_counter() - start
        tokens = first.tokens
        if tokens[-1] != eos:
            tokens += generate(model, ids.new_tensor([tokens]), new_tokens - 1, cache=cache).tokens
        rows.append((first.prompt_len - first.cached_tokens, ttft, tokens))
        cache.reset()
    return rows


def _span(values) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}..{max(values):.3f})"


def chat(model, prompts, new_tokens: int, rounds: int = 3) -> dict:
    """The chat without and with the prefix cache, alternating which goes first each round."""
    runs = {False: [], True: []}
    for r in range(rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            runs[mode].append(_chat_once(model, prompts, new_tokens, mode))
    out = {"prompt": [p.shape[1] for p in prompts], "rounds": rounds}
    for mode, name in ((False, "plain"), (True, "cached")):
        out[f"{name}_computed"] = [row[0] for row in runs[mode][0]]
        out[f"{name}_ttft"] = [[run[t][1] for run in runs[mode]] for t in range(len(prompts))]
    out["same_tokens"] = all(a[2] == b[2] for run_a, run_b in zip(runs[False], runs[True])
                             for a, b in zip(run_a, run_b))
    last = len(prompts) - 1
    plain, cached = out["plain_ttft"][last], out["cached_ttft"][last]
    print(f"{len(prompts)} turns, {sum(out['prompt']):,} prompt tokens: prefill computed "
          f"{sum(out['plain_computed']):,} without the prefix cache, "
          f"{sum(out['cached_computed']):,} with it; time to first token at turn {last + 1}: "
          f"{_span(plain)} without, {_span(cached)} with "
          f"({statistics.median(plain) / statistics.median(cached):.1f}x), medians of "
          f"{rounds} rounds (min..max); "
          f"answers identical: {out['same_tokens']}")
    return out


def request_mix(model, tok, systems: list[str], questions: list[str], seed: int = 0) -> dict:
    """Every question under every system prompt, in a seeded shuffle, each prefilled on one
    prefix-caching pool: the share of prompt tokens found cached (only prefills: one new token)."""
    requests = [chat_ids(tok, [{"role": "system", "content": s}, {"role": "user", "content": q}],
                         model.device) for s in systems for q in questions]
    random.Random(seed).shuffle(requests)
    pool = _pool(model, requests, 1, prefix_cache=True)
    cached = prompt = 0
    for ids in requests:
        g = generate(model, ids, 1, cache=PagedCache(pool))
        g.cache.reset()
        cached, prompt = cached + g.cached_tokens, prompt + g.prompt_len
    print(f"{len(requests)} requests ({len(systems)} system prompts x {len(questions)} questions, "
          f"shuffled): {cached:,} of {prompt:,} prompt tokens found cached, a hit rate of "
          f"{cached / prompt:.1%}")
    return {"requests": len(requests), "cached": cached, "prompt": prompt}


def _forward_ms(model, ids, rows: int, reps: int = 5) -> float:
    """Median ms of one forward at the prompt's end over ``rows`` rows, each at its own slot as the
    verify forward runs them, cropped back after each."""
    cache = generate(model, ids, 1, max_seq=ids.shape[1] + rows).cache  # holds the prompt
    pos, feed = cache.seq_len, [ids[:, -1:]] * rows
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        forward(model, feed, [cache] * rows, [pos + i for i in range(rows)]).tolist()
        times.append(time.perf_counter() - start)
        cache.crop(pos)
    return 1e3 * statistics.median(times[1:])


def _mid(values) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})"


def lookup(model, tasks: dict, new_tokens: int, k: int, rounds: int = 5) -> dict:
    """Per task, plain greedy and prompt lookup (``k`` guesses) timed in alternating rounds:
    tokens per second over the whole request (the same prefill in both) and over the decode only
    (the time of the prefill and first token, measured in the same round, taken off); and one
    forward at the prompt's end over 1 row against ``k + 1`` rows."""
    out = {}
    for name, ids in tasks.items():
        times, gens, first = {None: [], k: []}, {}, []
        for r in range(rounds):
            start = time.perf_counter()
            generate(model, ids, 1)
            first.append(time.perf_counter() - start)
            for mode in (None, k) if r % 2 == 0 else (k, None):
                start = time.perf_counter()
                gens[mode] = generate(model, ids, new_tokens, prompt_lookup_num_tokens=mode)
                times[mode].append(time.perf_counter() - start)
        g, n = gens[k], len(gens[k].tokens)
        tps = {mode: [n / t for t in ts] for mode, ts in times.items()}
        decode = {mode: [(n - 1) / max(t - f, 1e-9) for t, f in zip(ts, first)]
                  for mode, ts in times.items()}
        ms = {rows: _forward_ms(model, ids, rows) for rows in (1, k + 1)}
        out[name] = {"plain": tps[None], "lookup": tps[k], "tokens": n,
                     "decode_plain": decode[None], "decode_lookup": decode[k], "forward_ms": ms,
                     "same": g.tokens == gens[None].tokens, "accepted": g.accepted,
                     "drafted": g.drafted, "forwards": g.forwards,
                     "per_forward": (n - 1) / g.forwards}
        ratio = {key: statistics.median(v[k]) / statistics.median(v[None])
                 for key, v in (("whole", tps), ("decode", decode))}
        print(f"{name}: {n} tokens, identical {out[name]['same']}; guesses kept "
              f"{g.accepted}/{g.drafted} over {g.forwards} forwards, "
              f"{out[name]['per_forward']:.2f} tokens a forward; one forward at this context: "
              f"1 row {ms[1]:.1f} ms, {k + 1} rows {ms[k + 1]:.1f} ms. Tokens/s, median of "
              f"{rounds} rounds (min..max), whole request: plain {_mid(tps[None])}, lookup "
              f"{_mid(tps[k])}, {ratio['whole']:.2f}x; decode only: plain {_mid(decode[None])}, "
              f"lookup {_mid(decode[k])}, {ratio['decode']:.2f}x")
    return out


def _bars(ax, groups: list[str], series: dict[str, list[list[float]]]) -> None:
    """Median bars with min..max whiskers, one colour a series, groups side by side."""
    width = 0.8 / len(series)
    for i, (name, samples) in enumerate(series.items()):
        mid = [statistics.median(s) for s in samples]
        x = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(x, mid, width, label=name, yerr=[[m - min(s) for m, s in zip(mid, samples)],
                                                [max(s) - m for m, s in zip(mid, samples)]],
               capsize=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def figure(chat_out: dict, lookup_out: dict, label: str) -> Figure:
    """Left: time to first token per turn, without and with the prefix cache. Right: tokens/s of
    plain greedy and prompt lookup per task. Medians, whiskers min..max; saved as nb09_reuse."""
    fig = Figure(figsize=(10, 4.6))
    fig.suptitle("Reuse: the prefix cache and prompt lookup", fontweight="bold")
    fig.subplots_adjust(bottom=0.25, top=0.85, wspace=0.3)
    fig.text(0.5, 0.01, label, ha="center", va="bottom", fontsize=7, color="0.35", wrap=True)
    left, right = fig.subplots(1, 2)
    turns = [f"turn {t + 1}\ncached run: {c} of {p}\ncomputed" for t, (c, p) in
             enumerate(zip(chat_out["cached_computed"], chat_out["prompt"]))]
    _bars(left, turns, {"no prefix cache": chat_out["plain_ttft"],
                        "prefix cache": chat_out["cached_ttft"]})
    left.set(ylabel="time to first token (s)", title="multi-turn chat: prefill skipped")
    tasks = list(lookup_out)
    names = [f"{t}\n{o['accepted']} of {o['drafted']} guesses kept\n"
             f"{o['per_forward']:.2f} tokens a forward" for t, o in lookup_out.items()]
    _bars(right, names, {"plain greedy": [lookup_out[t]["plain"] for t in tasks],
                         "prompt lookup": [lookup_out[t]["lookup"] for t in tasks]})
    right.set(ylabel="tokens/s (whole request)", title="prompt lookup: where it hits, where not")
    plots.save(fig, "nb09_reuse", {"chat": chat_out, "lookup": lookup_out}, label)
    return fig
