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
          f"({statistics.median(plain) / statistics.median(cached):.1f}x), {rounds} rounds; "
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


def lookup(model, tasks: dict, new_tokens: int, k: int, rounds: int = 5) -> dict:
    """Per task, plain greedy and prompt lookup (``k`` guesses) timed in alternating rounds:
    tokens per second over the whole request (the same prefill in both)."""
    out = {}
    for name, ids in tasks.items():
        times, gens = {None: [], k: []}, {}
        for r in range(rounds):
            for mode in (None, k) if r % 2 == 0 else (k, None):
                start = time.perf_counter()
                gens[mode] = generate(model, ids, new_tokens, prompt_lookup_num_tokens=mode)
                times[mode].append(time.perf_counter() - start)
        g, n = gens[k], len(gens[k].tokens)
        tps = {mode: [n / t for t in ts] for mode, ts in times.items()}
        out[name] = {"plain": tps[None], "lookup": tps[k], "tokens": n,
                     "same": g.tokens == gens[None].tokens, "accepted": g.accepted,
                     "drafted": g.drafted, "per_forward": (n - 1) / g.forwards}
        ratio = statistics.median(tps[k]) / statistics.median(tps[None])
        print(f"{name}: {n} tokens, identical {out[name]['same']}; guesses kept "
              f"{g.accepted}/{g.drafted} ({g.accepted / max(g.drafted, 1):.0%}), "
              f"{out[name]['per_forward']:.2f} tokens a forward; tokens/s plain "
              f"{statistics.median(tps[None]):.1f} ({min(tps[None]):.1f}..{max(tps[None]):.1f}), "
              f"lookup {statistics.median(tps[k]):.1f} ({min(tps[k]):.1f}..{max(tps[k]):.1f}): "
              f"{ratio:.2f}x")
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
    fig = Figure(figsize=(10, 4), layout="constrained")
    fig.suptitle("Reuse: the prefix cache and prompt lookup", fontweight="bold")
    fig.text(0.5, 0.005, label, ha="center", fontsize=7, color="0.35", wrap=True)
    left, right = fig.subplots(1, 2)
    turns = [f"turn {t + 1}\n{c} / {p} computed" for t, (c, p) in
             enumerate(zip(chat_out["cached_computed"], chat_out["prompt"]))]
    _bars(left, turns, {"no prefix cache": chat_out["plain_ttft"],
                        "prefix cache": chat_out["cached_ttft"]})
    left.set(ylabel="time to first token (s)", title="multi-turn chat: prefill skipped")
    tasks = list(lookup_out)
    _bars(right, tasks, {"plain greedy": [lookup_out[t]["plain"] for t in tasks],
                         "prompt lookup": [lookup_out[t]["lookup"] for t in tasks]})
    right.set(ylabel="tokens/s (whole request)", title="prompt lookup: where it hits, where not")
    plots.save(fig, "nb09_reuse", {"chat": chat_out, "lookup": lookup_out}, label)
    return fig
