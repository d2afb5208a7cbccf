"""Notebook 08's machinery: logits at every position of a text over any cache, the accuracy of
each cache against the fp32 one, the answer figure, the simulated 12 GiB card's tail of a run,
greedy agreement with its near-ties, and the timing of a decode step over each cache.

The notebook keeps what it teaches: the bytes arithmetic, quantizing a row, the meter and the
ledger on one step, the ring's slots, parity with transformers, and the sinks' perplexity figure.
"""

import statistics

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from transformers import QuantizedCache

from kvlib import KVCache, QuantCache, RingCache, forward, generate
from kvlib.config import MIB
from kvlib.meter import fill

from . import plots
from .rounds import disturbed, flag_label, report, rounds, timed

__all__ = ["accuracy", "answer_figure", "chunk_logits", "every_logits", "greedy", "sinks_figure",
           "time_steps"]

CHUNK = 128  # the text goes through in chunks, each over the slots the cache already holds


@torch.no_grad()
def chunk_logits(model, cache, ids, chunk: int = CHUNK):
    """Logits ``[n, V]`` at every position of each chunk of ``ids [1, N]``, chunk after chunk,
    through ``kvlib.forward`` over ``cache``: forward returns the last position's only, so two hooks
    catch the last layer's residual stream and the model's own norm and head finish it. Checks,
    chunk by chunk, that the hook's last row is forward's own logits."""
    last, caught = model.model.layers[-1], {}
    hooks = [last.post_attention_layernorm.register_forward_hook(
                 lambda m, args, o: caught.update(x=args[0])),
             last.mlp.register_forward_hook(lambda m, args, o: caught.update(mlp=o))]
    try:
        for start in range(0, ids.shape[1], chunk):
            final = forward(model, ids[:, start:start + chunk], cache, start)
            logits = model.lm_head(model.model.norm(caught["x"] + caught["mlp"]))[0]
            torch.testing.assert_close(logits[-1], final[0], rtol=1e-4, atol=1e-4)
            yield logits
    finally:
        for hook in hooks:
            hook.remove()


def every_logits(model, cache, ids, chunk: int = CHUNK) -> torch.Tensor:
    """Logits ``[N, V]`` at every position of ``ids [1, N]`` (:func:`chunk_logits`, joined)."""
    return torch.cat(list(chunk_logits(model, cache, ids, chunk)))


def _score(name, per_token, logits, ref_logits, targets) -> dict:
    nll = F.cross_entropy(logits[:-1], targets, reduction="none")
    err = (logits - ref_logits).abs()
    pos = err.amax(-1)  # [n]: each position's largest logit error
    return dict(name=name, bytes=per_token, nll=nll, ppl=nll.mean().exp().item(),
                err=err.max().item(), mean_err=err.mean().item(), under_1=int((pos < 1).sum()),
                agree=int((logits.argmax(-1) == ref_logits.argmax(-1)).sum()))


def accuracy(model, ids, window: int = 128, sinks: int = 4) -> dict:
    """Every cache over the same text ``ids [1, n]``, scored against the fp32 cache: perplexity,
    logit errors, positions whose largest error is under one logit, same argmax. ``{name: row}``;
    the fp32 row's ``hf`` is its largest distance from transformers' own forward."""
    cfg, n, dtype = model.config, ids.shape[1], model.dtype
    ref = every_logits(model, KVCache.for_model(cfg, n, device="cpu", dtype=dtype), ids)
    with torch.no_grad():
        hf = (ref - model(ids).logits[0]).abs().max().item()
    targets = ids[0, 1:]
    caches = {
        "int8 QuantCache": QuantCache.for_model(cfg, n, bits=8, device="cpu", dtype=dtype),
        "int4 QuantCache": QuantCache.for_model(cfg, n, bits=4, device="cpu", dtype=dtype),
        f"window {window}": RingCache.for_model(cfg, window, device="cpu", dtype=dtype),
        f"window {window} + {sinks} sinks": RingCache.for_model(cfg, window, sinks=sinks,
                                                                device="cpu", dtype=dtype),
    }
    rows = {"fp32 KVCache": {**_score("fp32 KVCache", 2 * cfg.num_hidden_layers
                                      * cfg.num_key_value_heads * cfg.head_dim * 4, ref, ref,
                                      targets), "hf": hf}}
    for name, cache in caches.items():
        per_token = cache.bytes_per_token if isinstance(cache, QuantCache) else None
        rows[name] = _score(name, per_token, every_logits(model, cache, ids), ref, targets)
    with torch.no_grad():  # transformers' own fp8: one scale per tensor, set by the first chunk
        fp8 = QuantizedCache("fp8", cfg)
        logits = torch.cat([model(ids[:, s:s + CHUNK], cache=fp8).logits[0]
                            for s in range(0, n, CHUNK)])
    rows["transformers fp8"] = _score("transformers fp8", rows["fp32 KVCache"]["bytes"] // 4,
                                      logits, ref, targets)
    return rows


def answer_figure(rows: dict, n: int, label: str) -> Figure:
    """The KV bytes each cache holds for ``n`` tokens of text (left) beside the perplexity it gives
    on that text (right, fp32's dashed): fewer bytes by quantizing and by forgetting."""
    full = rows["fp32 KVCache"]["bytes"]
    names = list(rows)
    held = [n * rows[k]["bytes"] if rows[k]["bytes"] else
            full * (int(k.split()[1]) + (int(k.split()[3]) if "sinks" in k else 0)) for k in names]
    ppl = [rows[k]["ppl"] for k in names]
    fig, (left, right) = plots.figure(f"KV bytes for {n:,} tokens of text, and the perplexity each "
                                      "cache gives", f"{label} · smollm2-135m", size=(7.5, 3.6),
                                      panels=2, sharey=True)
    colors = ["0.3", "tab:blue", "tab:red", "tab:orange", "tab:green", "tab:purple"]
    for ax, values, xlabel in ((left, [h / MIB for h in held], "KV bytes held (MiB)"),
                               (right, ppl, "perplexity (lower is better)")):
        ax.barh(range(len(names)), values, color=colors[:len(names)])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
        ax.set_xlim(0, 1.2 * max(values))
        ax.set_xlabel(xlabel)
        ax.grid(False, axis="y")
    right.axvline(ppl[0], color="k", lw=1, ls="--")
    left.set_yticks(range(len(names)), names, fontsize=8)
    left.invert_yaxis()
    plots.save(fig, "nb08_answer", data={"n": n, "held": dict(zip(names, held)),
                                         "perplexity": dict(zip(names, ppl))}, label=label)
    return fig


def sinks_figure(rows: dict, window: int, label: str, bucket: int = CHUNK) -> Figure:
    """Perplexity by stretch of the text: the full cache, the plain window, the window + sinks."""
    names = ["fp32 KVCache"] + [k for k in rows if k.startswith("window")]
    n = len(rows["fp32 KVCache"]["nll"])
    buckets = list(range(0, n, bucket))
    series = {k: [rows[k]["nll"][b:b + bucket].mean().exp().item() for b in buckets]
              for k in names}
    fig, ax = plots.figure(f"SmolLM2 past a window of {window}: without and with attention sinks",
                           f"{label} · smollm2-135m", f"position in the text (mean of {bucket} "
                           "tokens)", "perplexity", size=(7.5, 4))
    for k in names:
        style = dict(color="k", ls="--", lw=2, zorder=0) if k == "fp32 KVCache" else {}
        ax.plot([b + bucket // 2 for b in buckets], series[k], marker="o", ms=4, label=k, **style)
    ax.axvline(window, color="0.5", lw=1, ls="--", label=f"the window's end ({window})")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    plots.save(fig, "nb08_sinks", data={"positions": buckets, "bucket": bucket, "window": window,
                                        "perplexity": series}, label=label)
    return fig


def greedy(model, prompt, n: int = 256) -> dict:
    """fp32's greedy continuation of ``prompt``, then each quantized cache fed it (the same history
    at every step): where its pick differs, fp32's top-2 margin there against twice its largest
    logit error there (a flip beyond that would be a bug, not rounding). Then int8 on its own:
    how many tokens it shares with fp32 before the first difference, and that step's margin."""
    ref = generate(model, prompt, n, eos_token_id=None, return_logits=True)
    want, tokens = torch.stack(ref.logits), torch.tensor(ref.tokens)  # [n, V], [n]
    top = want.topk(2, -1).values
    margin = top[:, 0] - top[:, 1]  # [n]
    seq = torch.cat([prompt, tokens[None, :-1]], dim=1)
    out = {"margin": margin}
    for bits in (8, 4):
        cache = QuantCache.for_model(model.config, seq.shape[1], bits=bits, device="cpu",
                                     dtype=model.dtype)
        logits = every_logits(model, cache, seq)[prompt.shape[1] - 1:]
        err = (logits - want).abs().amax(-1)  # [n]
        differ = logits.argmax(-1) != tokens
        out[bits] = dict(agree=int((~differ).sum()), err=err,
                         ties=bool((margin[differ] <= 2 * err[differ]).all()))
    free = generate(model, prompt, n, eos_token_id=None,
                    cache=QuantCache.for_model(model.config, prompt.shape[1] + n, device="cpu",
                                               dtype=model.dtype))
    same = next((i for i, (a, b) in enumerate(zip(free.tokens, ref.tokens)) if a != b), n)
    out["free"] = dict(same=same, tokens=free.tokens, ref=ref.tokens,
                       tie=same == n or margin[same].item() <= 2 * out[8]["err"][same].item())
    return out


def _step(model, kind: str, T: int, ring: int):
    """A cache holding ``T`` positions (zeros) and its decode step at position ``T``."""
    cfg, dtype, token = model.config, model.dtype, torch.zeros(1, 1, dtype=torch.long)
    if kind.startswith("ring"):
        cache = RingCache.for_model(cfg, ring, device="cpu", dtype=dtype)
        fill(cache, T)
        pos = iter(range(T, T + 10_000))  # a ring only moves forward
    else:
        bits = {"fp32": None, "int8": 8, "int4": 4}[kind]
        cache = (KVCache.for_model(cfg, T + 1, device="cpu", dtype=dtype) if bits is None else
                 QuantCache.for_model(cfg, T + 1, bits=bits, device="cpu", dtype=dtype))
        cache.seq_len = T
        pos = iter([T] * 10_000)  # rewrites slot T: the same step every time
    return lambda: forward(model, token, cache, next(pos))


def time_steps(model, label: str, contexts=(512, 2048), rounds_n: int = 7, ring: int = 256):
    """Each cache's decode step over fp32's, timed in rounds (:mod:`course.rounds`: a ratio
    compares two steps of the same spell of a shared machine); a warm-up round first. Prints one
    line; returns the figure (median and range of the rounds' ratios)."""
    kinds = ["fp32", "int8", "int4", f"ring W={ring}"]
    steps = {(k, T): _step(model, k, T, ring) for T in contexts for k in kinds}
    ms = rounds({key: timed(step, "cpu", repeats=5, warmup=1) for key, step in steps.items()},
                rounds_n, warmup=1)
    ms = {key: [s * 1e3 for s in v] for key, v in ms.items()}
    ratio = {(k, T): [a / b for a, b in zip(ms[k, T], ms["fp32", T])]
             for k in kinds[1:] for T in contexts}
    flagged = disturbed({f"{k} at {T:,} (ms)": v for (k, T), v in ms.items()})
    label = flag_label(f"{label} · smollm2-135m", flagged)
    fig, ax = plots.figure("Time per decode step over fp32's (median, range of the rounds)", label,
                           ylabel="time per step / fp32's", size=(7.5, 3.8))
    for i, T in enumerate(contexts):
        mid = [statistics.median(ratio[k, T]) for k in kinds[1:]]
        x = [j + 0.35 * (i - 0.5) for j in range(len(kinds) - 1)]
        ax.bar(x, mid, width=0.33, label=f"{T:,} tokens", color=["tab:blue", "tab:orange"][i],
               yerr=[[m - min(ratio[k, T]) for m, k in zip(mid, kinds[1:])],
                     [max(ratio[k, T]) - m for m, k in zip(mid, kinds[1:])]], capsize=3)
    ax.axhline(1, color="k", lw=1, ls="--")
    ax.set_xticks(range(len(kinds) - 1), kinds[1:])
    ax.grid(False, axis="x")
    ax.legend(fontsize=8)
    plots.save(fig, "nb08_time", data={"ms": {f"{k} @ {T}": v for (k, T), v in ms.items()},
                                       "flagged": flagged}, label=label)
    report("step time over fp32's (median of rounds): " + "; ".join(
        f"{k} {', '.join(f'{statistics.median(ratio[k, T]):.2f}x' for T in contexts)}"
        for k in kinds[1:]) + f" at {' and '.join(f'{T:,}' for T in contexts)} tokens", flagged)
    return fig
