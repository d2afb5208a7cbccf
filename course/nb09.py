"""Notebook 09's measuring machinery (reuse and rollback): a multi-turn chat with and without the
prefix cache, the hit rate of a request mix, prompt lookup against plain greedy, each timed in
interleaved rounds (medians and spreads), and the figure that answers the notebook's question.

Each public function is one notebook cell: it measures, returns its numbers and prints one line.
"""

import random
import statistics
import time
from functools import partial

import torch
from matplotlib.figure import Figure

from kvlib import generate
from kvlib.decoder import forward
from kvlib.paged_cache import BlockPool, PagedCache
from kvlib.timing import time_fn

from . import plots, say
from .rounds import disturbed, report, rounds, shown

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


def chat(model, prompts, new_tokens: int, rounds_n: int = 3) -> dict:
    """The chat without and with the prefix cache, taking turns in rounds (:mod:`course.rounds`)."""
    runs = rounds({mode: partial(_chat_once, model, prompts, new_tokens, mode)
                   for mode in (False, True)}, rounds_n)
    out = {"prompt": [p.shape[1] for p in prompts], "rounds": rounds_n}
    for mode, name in ((False, "plain"), (True, "cached")):
        out[f"{name}_computed"] = [row[0] for row in runs[mode][0]]
        out[f"{name}_ttft"] = [[run[t][1] for run in runs[mode]] for t in range(len(prompts))]
    out["same_tokens"] = all(a[2] == b[2] for run_a, run_b in zip(runs[False], runs[True])
                             for a, b in zip(run_a, run_b))
    last = len(prompts) - 1
    plain, cached = out["plain_ttft"][last], out["cached_ttft"][last]
    report(f"{len(prompts)} turns, {sum(out['prompt']):,} prompt tokens: prefill computed "
           f"{sum(out['plain_computed']):,} without the prefix cache, "
           f"{sum(out['cached_computed']):,} with it; time to first token at turn {last + 1}, "
           f"median of {rounds_n} rounds (min..max): {shown(plain, '.3f')} s without, "
           f"{shown(cached, '.3f')} s with "
           f"({statistics.median(plain) / statistics.median(cached):.1f}x); answers identical: "
           f"{out['same_tokens']}", disturbed({f"turn {t + 1} {name} (s)": v for name in
                                                ("plain", "cached")
                                                for t, v in enumerate(out[f"{name}_ttft"])}))
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
    say(f"{len(requests)} requests ({len(systems)} system prompts x {len(questions)} questions, "
          f"shuffled): {cached:,} of {prompt:,} prompt tokens found cached, a hit rate of "
          f"{cached / prompt:.1%}")
    return {"requests": len(requests), "cached": cached, "prompt": prompt}


def _forward_ms(model, ids, rows: int) -> float:
    """Median ms of one forward at the prompt's end over ``rows`` rows, each at its own slot as the
    verify forward runs them, cropped back after each."""
    cache = generate(model, ids, 1, max_seq=ids.shape[1] + rows).cache  # holds the prompt
    pos, feed = cache.seq_len, [ids[:, -1:]] * rows

    def verify():
        forward(model, feed, [cache] * rows, [pos + i for i in range(rows)])
        cache.crop(pos)
    return time_fn(verify, device=model.device, warmup=1, repeats=5).ms


def decode_rates(whole_s: list, first_s: list, tokens: int) -> list[float]:
    """Tokens/s of the decode alone, a round's whole request less the median prefill and first
    token: one slow first token cannot leave a near-zero time to divide by. A round no longer than
    that median has no decode time to read and is left out (all of them: ``[0.0]``)."""
    first = statistics.median(first_s)
    return [(tokens - 1) / (t - first) for t in whole_s if t > first] or [0.0]


def lookup(model, tasks: dict, new_tokens: int, k: int, rounds_n: int = 5) -> dict:
    """Per task, plain greedy and prompt lookup (``k`` guesses) timed in rounds
    (:mod:`course.rounds`) with the prefill and first token alone: tokens per second over the
    whole request (the same prefill in both) and over the decode only (the median time of the
    prefill and first token taken off); and one forward at the prompt's end over 1 row against
    ``k + 1`` rows."""
    out, modes = {}, {"first": (1, None), "plain": (new_tokens, None), "lookup": (new_tokens, k)}
    for name, ids in tasks.items():
        gens = {}

        def run(mode, ids=ids, gens=gens):
            start = time.perf_counter()
            n, guesses = modes[mode]
            gens[mode] = generate(model, ids, n, prompt_lookup_num_tokens=guesses)
            return time.perf_counter() - start

        times = rounds({mode: partial(run, mode) for mode in modes}, rounds_n)
        g, n = gens["lookup"], len(gens["lookup"].tokens)
        tps = {mode: [n / t for t in times[mode]] for mode in ("plain", "lookup")}
        decode = {mode: decode_rates(times[mode], times["first"], n)
                  for mode in ("plain", "lookup")}
        ms = {rows: _forward_ms(model, ids, rows) for rows in (1, k + 1)}
        out[name] = {"plain": tps["plain"], "lookup": tps["lookup"], "tokens": n,
                     "decode_plain": decode["plain"], "decode_lookup": decode["lookup"],
                     "forward_ms": ms, "same": g.tokens == gens["plain"].tokens,
                     "accepted": g.accepted, "drafted": g.drafted, "forwards": g.forwards,
                     "per_forward": (n - 1) / g.forwards}
        ratio = {key: statistics.median(v["lookup"]) / statistics.median(v["plain"])
                 for key, v in (("whole", tps), ("decode", decode))}
        report(f"{name}: {n} tokens, identical {out[name]['same']}; guesses kept "
               f"{g.accepted}/{g.drafted} over {g.forwards} forwards, "
               f"{out[name]['per_forward']:.2f} tokens a forward; one forward at this context: "
               f"1 row {ms[1]:.1f} ms, {k + 1} rows {ms[k + 1]:.1f} ms.\nTokens/s, median of "
               f"{rounds_n} rounds (min..max), whole request: plain {shown(tps['plain'])}, "
               f"lookup {shown(tps['lookup'])}, {ratio['whole']:.2f}x; decode only: plain "
               f"{shown(decode['plain'])}, lookup {shown(decode['lookup'])}, "
               f"{ratio['decode']:.2f}x", disturbed({f"{m} (s)": v for m, v in times.items()},
                                                    ".3f"))
    return out


def _bars(ax, groups: list[str], series: dict[str, list[list[float]]]) -> None:
    """Median bars with min..max whiskers, one colour a series, groups side by side; headroom
    above the tallest whisker for the legend, so that it covers no bar."""
    width = 0.8 / len(series)
    for i, (name, samples) in enumerate(series.items()):
        mid = [statistics.median(s) for s in samples]
        x = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(x, mid, width, label=name, yerr=[[m - min(s) for m, s in zip(mid, samples)],
                                                [max(s) - m for m, s in zip(mid, samples)]],
               capsize=3)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylim(0, 1.3 * max(max(s) for samples in series.values() for s in samples))
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    ax.grid(False, axis="x")


def figure(chat_out: dict, lookup_out: dict, label: str) -> Figure:
    """Left: time to first token per turn, without and with the prefix cache. Right: tokens/s of
    plain greedy and prompt lookup per task. Medians, whiskers min..max; saved as nb09_reuse."""
    fig, (left, right) = plots.figure("Reuse: the prefix cache and prompt lookup", label,
                                      size=(10, 4.6), panels=2)
    turns = [f"turn {t + 1}\nprefix cache:\n{c} of {p} computed" for t, (c, p) in
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
