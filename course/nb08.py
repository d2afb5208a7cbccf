"""Notebook 08's machinery: logits at every position over any cache, accuracy against fp32, the
figures, the decode step's time. The notebook keeps what it teaches in its cells."""

import statistics

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from transformers import QuantizedCache

from kvlib import KVCache, QuantCache, RingCache, forward
from kvlib.config import MIB
from kvlib.meter import fill

from . import plots
from .rounds import disturbed, flag_label, report, rounds, timed

CHUNK = 128  # the text goes through in chunks, each over the slots the cache already holds


@torch.no_grad()
def chunk_logits(model, cache, ids, chunk: int = CHUNK):
    """Logits ``[n, V]`` at every position of each chunk of ``ids [1, N]`` in turn, through
    ``forward`` over ``cache``, which returns the last position's only: two hooks catch the last
    layer's residual stream, the model's norm and head finish it, checked against forward's."""
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


def _score(name, held, logits, ref, targets) -> dict:
    nll = F.cross_entropy(logits[:-1], targets, reduction="none")
    err = (logits - ref).abs()
    return dict(name=name, held=held, nll=nll, ppl=nll.mean().exp().item(), err=err.max().item(),
                mean_err=err.mean().item(), under_1=int((err.amax(-1) < 1).sum()),
                agree=int((logits.argmax(-1) == ref.argmax(-1)).sum()))


def accuracy(model, ids, window: int = 128, sinks: int = 4) -> dict:
    """Every cache over the same text ``ids [1, n]``, scored against the fp32 cache (the first);
    the fp32 row's ``hf`` is its largest distance from transformers' own forward."""
    cfg, n, kw = model.config, ids.shape[1], dict(device="cpu", dtype=model.dtype)
    caches = {
        "fp32 KVCache": KVCache.for_model(cfg, n, **kw),
        "int8 QuantCache": QuantCache.for_model(cfg, n, bits=8, **kw),
        "int4 QuantCache": QuantCache.for_model(cfg, n, bits=4, **kw),
        f"window {window}": RingCache.for_model(cfg, window, **kw),
        f"window {window} + {sinks} sinks": RingCache.for_model(cfg, window, sinks=sinks, **kw)}
    rows, ref = {}, None
    for name, cache in caches.items():
        logits = torch.cat(list(chunk_logits(model, cache, ids)))
        ref = logits if ref is None else ref
        rows[name] = _score(name, cache.nbytes, logits, ref, ids[0, 1:])
    with torch.no_grad():  # transformers' own fp8: one scale per tensor, set by the first chunk
        rows["fp32 KVCache"]["hf"] = (ref - model(ids).logits[0]).abs().max().item()
        fp8 = QuantizedCache("fp8", cfg)
        logits = torch.cat([model(ids[:, s:s + CHUNK], cache=fp8).logits[0]
                            for s in range(0, n, CHUNK)])
    held = rows["fp32 KVCache"]["held"] // 4  # a byte an element, its per-tensor scales aside
    rows["transformers fp8"] = _score("transformers fp8", held, logits, ref, ids[0, 1:])
    return rows


def answer_figure(rows: dict, n: int, label: str) -> Figure:
    """KV bytes held beside perplexity: fewer bytes by quantizing and by forgetting."""
    names = list(rows)
    held, ppl = [rows[k]["held"] / MIB for k in names], [rows[k]["ppl"] for k in names]
    fig, (left, right) = plots.figure(f"KV bytes for {n:,} tokens of text, and the perplexity each "
                                      "cache gives", f"{label} · smollm2-135m", size=(7.5, 3.6),
                                      panels=2, sharey=True)
    colors = ["0.3", "tab:blue", "tab:red", "tab:orange", "tab:green", "tab:purple"]
    for ax, values, xlabel in ((left, held, "KV bytes held (MiB)"),
                               (right, ppl, "perplexity (lower is better)")):
        ax.bar_label(ax.barh(range(len(names)), values, color=colors[:len(names)]), fmt=" %.2f",
                     fontsize=8)
        ax.set(xlim=(0, 1.2 * max(values)), xlabel=xlabel)
        ax.grid(False, axis="y")
    right.axvline(ppl[0], color="k", lw=1, ls="--")
    left.set_yticks(range(len(names)), names, fontsize=8)
    left.invert_yaxis()
    plots.save(fig, "nb08_answer", data={"n": n, "held": {k: rows[k]["held"] for k in names},
                                         "perplexity": dict(zip(names, ppl))}, label=label)
    return fig


def sinks_figure(rows: dict, window: int, label: str, bucket: int = CHUNK) -> Figure:
    """Perplexity by stretch of the text: the full cache, the plain window, the window + sinks."""
    names = ["fp32 KVCache"] + [k for k in rows if k.startswith("window")]
    buckets = list(range(0, len(rows["fp32 KVCache"]["nll"]), bucket))
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


def _step(model, kind: str, T: int, ring: int):
    """A cache holding ``T`` positions (zeros) and its decode step at position ``T``: a ring only
    moves forward; the others rewrite slot ``T``, the same step every time."""
    cfg, kw = model.config, dict(device="cpu", dtype=model.dtype)
    cache = (RingCache.for_model(cfg, ring, **kw) if kind.startswith("ring") else
             KVCache.for_model(cfg, T + 1, **kw) if kind == "fp32" else
             QuantCache.for_model(cfg, T + 1, bits=int(kind[3:]), **kw))
    fill(cache, T)
    pos = iter(range(T, T + 10_000) if isinstance(cache, RingCache) else [T] * 10_000)
    return lambda: forward(model, torch.zeros(1, 1).long(), cache, next(pos))


def time_steps(model, label: str, contexts=(512, 2048), rounds_n: int = 7, ring: int = 256):
    """Each cache's decode step over fp32's, timed in rounds (:mod:`course.rounds`: a ratio
    compares two steps of the same spell of a shared machine); a warm-up round first."""
    kinds = ["fp32", "int8", "int4", f"ring W={ring}"]
    ms = rounds({(k, T): timed(_step(model, k, T, ring), "cpu", repeats=5, warmup=1)
                 for T in contexts for k in kinds}, rounds_n, warmup=1)
    ms = {key: [s * 1e3 for s in v] for key, v in ms.items()}
    ratio = {(k, T): [a / b for a, b in zip(ms[k, T], ms["fp32", T])]
             for k in kinds[1:] for T in contexts}
    flagged = disturbed({f"{k} at {T:,} (ms)": v for (k, T), v in ms.items()})
    label = flag_label(f"{label} · smollm2-135m", flagged)
    fig, ax = plots.figure("Time per decode step over fp32's (median, range of the rounds)", label,
                           ylabel="time per step / fp32's", size=(7.5, 3.8))
    plots.bars(ax, kinds[1:], {f"{T:,} tokens": [ratio[k, T] for k in kinds[1:]] for T in contexts})
    ax.axhline(1, color="k", lw=1, ls="--")
    plots.save(fig, "nb08_time", data={"ms": {f"{k} @ {T}": v for (k, T), v in ms.items()},
                                       "flagged": flagged}, label=label)
    report("step time over fp32's (median of rounds): " + "; ".join(
        f"{k} {', '.join(f'{statistics.median(ratio[k, T]):.2f}x' for T in contexts)}"
        for k in kinds[1:]) + f" at {' and '.join(f'{T:,}' for T in contexts)} tokens", flagged)
    return fig
