"""Notebook 01's machinery (no cache), one cell a function. A run whose numbers cannot be right
(:func:`problems`) says so once, in its line and its figure's label."""

from functools import partial

import numpy as np
import torch
from IPython.display import Image
from numpy.polynomial.polynomial import polyfit, polyval
from torch.profiler import record_function

import kvlib
from kvlib.bandwidth import decode_bytes, measure_bandwidth
from kvlib.timing import StepTimer

from . import plots, say
from .rounds import disturbed, flag_label, report, rounds, timed

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")  # where a profile puts a matrix product's time
OUTSIDE = "decode step: outside any aten op"  # the profiled step's own region: Python, modules


def problems(samples: dict) -> list[str]:
    """What cannot be right in ``{size: [seconds]}``: rounds of one size too far apart (a busy
    machine: :mod:`course.rounds`), or a larger size whose best beats a smaller one's by over a
    quarter (more work cannot take less time)."""
    slower = [f"size {big} ran faster than size {small}" for small, big in
              zip(samples, list(samples)[1:]) if 1.25 * min(samples[big]) < min(samples[small])]
    return disturbed({f"size {n} (ms)": [x * 1e3 for x in s] for n, s in samples.items()}) + slower


def no_cache_steps(model, lengths, label: str, s_star: float | None = None, rounds_n: int = 3):
    """A no-cache step (a forward over S random tokens) at each of ``lengths``, in rounds, its
    best fitted with a + b·S, or a + b·S + c·S² when ``s_star`` (the FLOP count's crossover) is
    given. A fitted term that grows with S is work: at or below zero it flags the run."""
    ids = torch.randint(0, model.config.vocab_size, (1, max(lengths)),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad():
        samples = rounds({S: timed(partial(model, ids[:, :S], use_cache=False), model.device)
                          for S in lengths}, rounds_n, 1)
    samples = {S: s for S, s in samples.items() if s}  # out of memory in every round: dropped
    sizes, best = list(samples), [min(s) for s in samples.values()]
    coef = polyfit(sizes, best, 1 if s_star is None else 2).tolist()  # seconds: a, b(, c)
    found = problems(samples) + [f"the fit's S^{p} term is {c:.3g} s, not above 0"
                                 for p, c in enumerate(coef) if p and c <= 0]
    shown, terms = flag_label(label, found), " + ".join(["a", "b·S", "c·S²"][:len(coef)])
    fig, axes = plots.figure(f"A no-cache step against S, and the fit {terms}", shown,
                             "S: tokens in the forward", size=(10, 4), panels=2)
    dense = np.arange(sizes[0], sizes[-1] + 1, max(1, sizes[-1] // 300))
    fits = [(3, "--", "0.3", f"fit: {terms}"), (2, ":", "0.6", "the fit without its S² term")]
    for ax, per_S, scale, what in ((axes[0], False, 1e3, "ms / step"),
                                   (axes[1], True, 1e6, "µs per token re-run")):
        ax.plot(sizes, [m * scale / (S if per_S else 1) for S, m in zip(sizes, best)], "o",
                zorder=3, label="measured: the best round")
        for k, style, color, name in fits[:len(coef) - 1]:  # k: the fit's first k terms
            ax.plot(dense, polyval(dense, coef[:k]) * scale / (dense if per_S else 1), style,
                    color=color, label=name)
        ax.set(ylabel=what, xlim=(0, None), ylim=(0, None))  # times and sizes start at zero
        ax.legend(fontsize=8)
    plots.save(fig, "nb01_time_per_step" if s_star is None else "nb01_quadratic", {"lengths": sizes,
               "samples_s": list(samples.values()), "fit": coef, "problems": found}, shown)
    off = max(abs(m / polyval(S, coef) - 1) for S, m in zip(sizes, best))
    a, b, c = coef + [0] * (3 - len(coef))
    report(f"S = {sizes[0]:,} to {sizes[-1]:,}: best step {best[0] * 1e3:.1f} to "
           f"{best[-1] * 1e3:.1f} ms, per token re-run {best[0] / sizes[0] * 1e6:,.0f} → "
           f"{best[-1] / sizes[-1] * 1e6:,.0f} µs; fit a = {a * 1e3:.1f} ms, b = {b * 1e6:,.1f} "
           f"µs a token, missing a length by at most {off:.0%}" + ("" if s_star is None else
           f"; at S = {sizes[-1]:,} the S² term is {c * sizes[-1] ** 2 / best[-1]:.0%} of the "
           f"step; crossover b / c = {f'{b / c:,.0f}' if b > 0 and c > 0 else 'none'} tokens "
           f"(the FLOP count's S* = {s_star:,.0f}, or {2 * s_star:,.0f} if the kernel skips the "
           "upper half)"), found)
    return coef, fig


def whole_generation(decode, model, n: int, coef, label: str):
    """``n`` tokens from a 1-token prompt with ``decode`` (no cache) and ``kvlib.generate``, against
    the fit ``coef`` = (a, b, c) summed over the steps: the figure the notebook opens with."""
    start, timer = torch.zeros(1, 1, dtype=torch.long, device=model.device), StepTimer(model.device)
    no_cache_tokens = decode(model, start, n, timer)
    no_cache = timer.times_s                                  # step i ran over S = i + 1 tokens
    cached = kvlib.generate(model, start, n, timed=True, eos_token_id=None)
    with_cache = [cached.prefill_s] + cached.step_s           # each produced one token
    predicted = polyval(np.arange(1, n + 1), coef)
    bend = [sum(s[n // 2:]) / sum(s[:n // 2]) for s in (no_cache, with_cache)]
    found = [why for bad, why in (
        (bend[0] < 1, "the no-cache second half, over longer forwards, took less time"),
        (sum(with_cache) > sum(no_cache), "the loop with a cache took longer in all")) if bad]
    shown = flag_label(label, found)
    fig, axes = plots.figure(f"Generating {n:,} tokens from a 1-token prompt (the tiny model)",
                             shown, "tokens generated", size=(10, 4), panels=2)
    for ax, f, what in ((axes[0], lambda s: np.multiply(s, 1e3), "ms for this token"),
                        (axes[1], np.cumsum, "seconds, cumulative")):
        for s, style, color, name in (
                (no_cache, "-", "tab:red", "no cache (re-run the prefix)"),
                (predicted, "--", "0.3", "predicted: the fit a + b·S + c·S²"),
                (with_cache, "-", "tab:blue", "kvlib.generate (a cache)")):
            ax.plot(range(1, n + 1), f(s), style, color=color, lw=1, label=name)
        ax.set(ylabel=what, xlim=(0, None), ylim=(0, None))
        ax.legend(fontsize=8)
    plots.save(fig, "nb01_cumulative_time", {"n_tokens": n, "no_cache_steps_s": no_cache,
               "cached_steps_s": with_cache, "fit_abc": list(coef), "problems": found}, shown)
    parted = next((i for i, (x, y) in enumerate(zip(cached.tokens, no_cache_tokens)) if x != y),
                  None)
    report(f"{n:,} tokens: no cache {sum(no_cache):.1f} s (the fit predicted "
           f"{sum(predicted):.1f} s), with a cache {sum(with_cache):.1f} s; second half over "
           f"first: no cache {bend[0]:.1f}x, with a cache {bend[1]:.1f}x; same tokens: "
           + (f"all {n:,}" if parted is None else f"the first {parted:,}, then they part"), found)
    return fig


def answer(name: str = "nb01_cumulative_time") -> Image:
    """The committed reference figure the notebook opens with, and its totals, with its label."""
    data, label = plots.load(name)
    totals = [sum(data[k]) for k in ("no_cache_steps_s", "cached_steps_s")]
    say(f"REFERENCE, figures/{name}.png ({label}): {data['n_tokens']:,} tokens, no cache "
        f"{totals[0]:.1f} s, with a cache {totals[1]:.1f} s")
    return Image(filename=str(plots.FIGURES / f"{name}.png"))


def roofs(device, dtype, size: int) -> tuple[float, float]:
    """This device's two roofs: FLOP/s of a ``size``² matmul (best of 5 rounds), a copy's GB/s."""
    x = torch.randn(size, size, device=device, dtype=dtype)
    peak = 2 * size**3 / min(rounds({"matmul": timed(lambda: x @ x, device)}, 5, 2)["matmul"])
    bandwidth = measure_bandwidth(device)
    say(f"peak {peak / 1e9:,.0f} GFLOP/s ({size}x{size} matmul, {str(dtype)[6:]}), bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (copy): ridge at {peak / bandwidth:.1f} FLOP per byte")
    return peak, bandwidth


def roofline(model, ns, peak: float, bandwidth: float, flops, label: str):
    """Prefills of ``n`` tokens (``n = 1``: a decode step's work) and a decode step after the
    longest, in rounds; ``flops(config, n, S)`` counts a forward's FLOPs."""
    config, dtype, device, big = model.config, model.dtype, model.device, max(ns)
    cache = kvlib.KVCache.for_model(config, big + 1, device=device, dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (1, big + 1),
                        generator=torch.Generator().manual_seed(2)).to(device)
    # Each prefill writes the same K/V into slots 0..n-1 (attention is causal): once the warm-up
    # round's longest prefill has run, the decode step reads, in any order, a full prompt's cache.
    calls = {n: timed(partial(kvlib.forward, model, ids[:, :n], cache, 0), device) for n in ns}
    calls["decode"] = timed(partial(kvlib.forward, model, ids[:, big:], cache, big), device)
    samples = rounds(calls, 3, 1)
    decode = samples.pop("decode")
    found = problems(samples) + disturbed({"decode step (ms)": [x * 1e3 for x in decode]})
    tpot, ridge, shown = min(decode), peak / bandwidth, flag_label(label, found)
    x = [flops(config, n, n) / decode_bytes(config, dtype, n) for n in samples]  # FLOP per byte
    rate = [flops(config, n, n) / min(s) for n, s in samples.items()]  # FLOP/s
    fig, ax = plots.figure("Roofline: a decode step and prefills of n tokens", shown,
                           "arithmetic intensity (FLOP per byte moved)", "achieved GFLOP/s",
                           size=(7, 4.4))
    roof = sorted([min(x) / 4, ridge, 4 * max(x)])
    ax.plot(roof, [min(peak, bandwidth * v) / 1e9 for v in roof], color="0.3",
            label=f"roof: min(peak {peak / 1e9:,.0f} GFLOP/s, "
                  f"{bandwidth / 1e9:.0f} GB/s × intensity)")
    ax.axvline(ridge, color="0.6", ls=":", lw=1, label=f"ridge: {ridge:.1f} FLOP/B")
    ax.plot(x, [r / 1e9 for r in rate], "o", color="tab:blue", label="measured forward")
    for n, at, r in zip(samples, x, rate):
        ax.annotate("decode step" if n == 1 else f"n={n}", (at, r / 1e9),
                    textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set(xscale="log", yscale="log")
    ax.legend(fontsize=8, loc="lower right")
    plots.save(fig, "nb01_roofline", {"n": list(samples), "prefill_s": list(samples.values()),
               "peak_flops": peak, "bandwidth": bandwidth, "tpot_s": tpot, "problems": found},
               shown)
    ttft, moved = min(samples[big]), decode_bytes(config, dtype, big + 1)
    report(f"TTFT of a {big}-token prompt {ttft * 1e3:.0f} ms ({ttft / big * 1e3:.2f} ms a "
           f"token), TPOT after it {tpot * 1e3:.1f} ms: {tpot / (ttft / big):.0f}x a prefilled "
           f"token; bytes ÷ bandwidth predicts {moved / bandwidth * 1e3:.1f} ms: the step reads at "
           f"{moved / tpot / 1e9:.1f} GB/s, {moved / tpot / bandwidth:.0%} of the copy's; share "
           "of the peak: " + ", ".join(f"n={n} {r / peak:.0%}" for n, r in zip(samples, rate)),
           found)
    return fig


def cpu_decode_step(model, context: int):
    """A warm decode step of SmolLM2-135M in fp32 on the CPU at ``context`` tokens, as a call: one
    region, :data:`OUTSIDE`, whose own time under a profiler is what ran between the aten ops."""
    if model.device.type != "cpu":
        model, _ = kvlib.load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    cache = kvlib.KVCache.for_model(model.config, context + 1, device="cpu", dtype=model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1),
                        generator=torch.Generator().manual_seed(3))
    kvlib.forward(model, ids[:, :context], cache, 0)

    def step():
        with record_function(OUTSIDE):
            return kvlib.forward(model, ids[:, context:], cache, context)
    for _ in range(2):  # warm-up: the profiled call is a third
        step()
    return step


def where_time_goes(events, config, top: int = 6) -> list[str]:
    """A profiled :func:`cpu_decode_step` (``prof.key_averages()``) by self time, an op's time
    without its children's, so the shares add up to the step: the ``top`` ops, then the matrix
    products (reading the weights) against the other aten op calls. The ops, largest first."""
    total = next(e.cpu_time_total for e in events if e.key == OUTSIDE)  # µs: the whole step
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)
    for e in ranked[:top]:
        print(f"  {e.key:50s} {e.count:4d} calls {e.self_cpu_time_total / 1e3:6.1f} ms "
              f"{e.self_cpu_time_total / total:4.0%}")
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    calls = sum(e.count for e in events if e.key not in MATMULS) - 1  # the step's region is no op
    weights = decode_bytes(config, torch.float32, 0)
    say(f"one step, {total / 1e3:.1f} ms under the profiler: the matrix products {mm / total:.0%},"
        f" reading the weights' {weights / 1e6:.0f} MB at {weights / mm / 1e3:.1f} GB/s; the other"
        f" {calls:,} aten op calls and the time between them {1 - mm / total:.0%}, "
        f"{(total - mm) / calls:.1f} µs a call")
    return [e.key for e in ranked]
