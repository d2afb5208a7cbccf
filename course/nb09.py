"""Notebook 09's measuring machinery: a multi-turn chat with and without the prefix cache, prompt
lookup against plain greedy, each timed in rounds (:mod:`course.rounds`), and the answer figure."""

import statistics
from functools import partial

import torch
from matplotlib.figure import Figure

from kvlib import forward, generate
from kvlib.paged_cache import BlockPool, PagedCache

from . import plots
from .rounds import disturbed, report, rounds, shown, timed

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


def _chat_once(model, prompts, new_tokens: int, prefix_cache: bool) -> list[tuple]:
    """Per turn on a fresh pool ``(tokens computed, time to first token, tokens)``; each answer's
    full blocks stay cached, so the next turn, which resends it, finds them."""
    blocks = sum(-(-(p.shape[1] + new_tokens) // BLOCK) for p in prompts)  # nothing evicted
    pool, rows = BlockPool.for_model(model.config, blocks, BLOCK, device=model.device,
                                     dtype=model.dtype, prefix_cache=prefix_cache), []
    for ids in prompts:
        g = generate(model, ids, new_tokens, cache=PagedCache(pool), timed=True)
        rows.append((g.prompt_len - g.cached_tokens, g.prefill_s, g.tokens))
        g.cache.reset()
    return rows


def chat(model, prompts, new_tokens: int, rounds_n: int = 3) -> dict:
    """The chat without and with the prefix cache, taking turns in rounds."""
    runs = rounds({mode: partial(_chat_once, model, prompts, new_tokens, mode)
                   for mode in (False, True)}, rounds_n)
    out = {"prompt": [p.shape[1] for p in prompts], "computed": [r[0] for r in runs[True][0]],
           "same_tokens": all(a[2] == b[2] for x, y in zip(runs[False], runs[True])
                              for a, b in zip(x, y))}
    out |= {f"{name}_ttft": [[run[t][1] for run in runs[mode]] for t in range(len(prompts))]
            for mode, name in ((False, "plain"), (True, "cached"))}
    plain, cached = out["plain_ttft"][-1], out["cached_ttft"][-1]
    x = statistics.median(plain) / statistics.median(cached)
    report(f"{len(prompts)} turns: the prefix cache computed {sum(out['computed']):,} of "
           f"{sum(out['prompt']):,} prompt tokens; time to first token at turn {len(prompts)}, "
           f"median of {rounds_n} rounds (min..max): {shown(plain, '.3f')} s without, "
           f"{shown(cached, '.3f')} s with ({x:.1f}x); answers identical: {out['same_tokens']}",
           disturbed({f"turn {t + 1} {name} (s)": v for name in ("plain", "cached")
                      for t, v in enumerate(out[f"{name}_ttft"])}, ".3f"))
    return out


def decode_rates(whole_s: list, first_s: list, tokens: int) -> list[float]:
    """Tokens/s of the decode alone: each round's whole request less the fastest first token. Only
    other programs add to the same work's time, so what is left is never less than that round's
    own decode: no near-zero time to divide by. A round no longer than the fastest first token
    (timer noise) is left out; none left: ``[0.0]``."""
    first = min(first_s)
    return [(tokens - 1) / (t - first) for t in whole_s if t > first] or [0.0]


def lookup(model, tasks: dict, new_tokens: int, k: int, rounds_n: int = 5) -> dict:
    """Per task, plain greedy and prompt lookup (``k`` guesses) timed in rounds with the first
    token alone: tokens/s of the whole request and of the decode only (:func:`decode_rates`); and
    one forward over 1 row and over ``k + 1`` rows, as the verify forward runs them."""
    out, modes = {}, {"first": (1, None), "plain": (new_tokens, None), "lookup": (new_tokens, k)}
    for name, ids in tasks.items():
        gens, cache = {}, generate(model, ids, 1, max_seq=ids.shape[1] + k + 1).cache
        pos = cache.seq_len  # the cache holds the prompt; each verify forward is cropped back

        def run(mode, ids=ids, gens=gens):
            n, guesses = modes[mode]
            gens[mode] = generate(model, ids, n, prompt_lookup_num_tokens=guesses)

        def verify(rows, ids=ids, cache=cache, pos=pos):
            forward(model, [ids[:, -1:]] * rows, [cache] * rows, [pos + i for i in range(rows)])
            cache.crop(pos)

        calls = {mode: timed(partial(run, mode), model.device) for mode in modes}
        calls |= {rows: timed(partial(verify, rows), model.device, 3, 1) for rows in (1, k + 1)}
        times = rounds(calls, rounds_n)
        g, n = gens["lookup"], len(gens["lookup"].tokens)
        ms = {rows: statistics.median(times.pop(rows)) * 1e3 for rows in (1, k + 1)}
        rate = {m: [n / t for t in times[m]] for m in ("plain", "lookup")} | {
            f"decode_{m}": decode_rates(times[m], times["first"], n) for m in ("plain", "lookup")}
        x = {key: statistics.median(rate[key + "lookup"]) / statistics.median(rate[key + "plain"])
             for key in ("", "decode_")}
        out[name] = dict(rate, tokens=n, forward_ms=ms, same=g.tokens == gens["plain"].tokens,
                         accepted=g.accepted, drafted=g.drafted, forwards=g.forwards,
                         per_forward=(n - 1) / g.forwards)
        report(f"{name}: {n} tokens, identical {out[name]['same']}; guesses kept "
               f"{g.accepted}/{g.drafted} over {g.forwards} forwards, "
               f"{out[name]['per_forward']:.2f} tokens a forward; one forward at this context: "
               f"1 row {ms[1]:.1f} ms, {k + 1} rows {ms[k + 1]:.1f} ms.\nTokens/s, median of "
               f"{rounds_n} rounds (min..max), whole request: plain {shown(rate['plain'])}, "
               f"lookup {shown(rate['lookup'])}, {x['']:.2f}x; decode only: plain "
               f"{shown(rate['decode_plain'])}, lookup {shown(rate['decode_lookup'])}, "
               f"{x['decode_']:.2f}x", disturbed({f"{m} (s)": v for m, v in times.items()}, ".3f"))
    return out


def figure(chat_out: dict, lookup_out: dict, label: str) -> Figure:
    """Time to first token per turn without and with the prefix cache; tokens/s of plain greedy
    and prompt lookup per task."""
    fig, (left, right) = plots.figure("Reuse: the prefix cache and prompt lookup", label,
                                      size=(10, 4.4), panels=2)
    plots.bars(left, [f"turn {t + 1}\n{c} of {p}" for t, (c, p) in enumerate(zip(
        chat_out["computed"], chat_out["prompt"]))], {
        "no prefix cache": chat_out["plain_ttft"], "prefix cache": chat_out["cached_ttft"]})
    left.set(title="multi-turn chat: prefill skipped", ylabel="time to first token (s)",
             xlabel="turn: prompt tokens the cached run computed")
    plots.bars(right, [f"{t}\n{o['accepted']} of {o['drafted']} kept\n{o['per_forward']:.2f} a "
                       "forward" for t, o in lookup_out.items()],
               {m: [o[key] for o in lookup_out.values()] for m, key in
                (("plain greedy", "plain"), ("prompt lookup", "lookup"))})
    right.set(title="prompt lookup: where it hits, where not", ylabel="tokens/s (whole request)",
              xlabel="task: guesses kept, tokens a forward")
    plots.save(fig, "nb09_reuse", {"chat": chat_out, "lookup": lookup_out}, label)
    return fig
