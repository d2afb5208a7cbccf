"""Notebook 01's measuring machinery (no cache): timing rounds, fits, the check for a run that
something else slowed, and the figures. Each public function is one notebook cell: it measures,
prints one line and returns what the next cell needs (a fit, a figure).

Sizes take turns over rounds, so load on the machine hits them alike, and each keeps its best
round: other work on a shared machine only ever adds time. A run whose numbers cannot be right
(:func:`problems`, or a fitted term below zero) is flagged once, in its line and its figure's label.
"""

from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
from IPython.display import Image
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

import kvlib
from kvlib.bandwidth import decode_bytes, measure_bandwidth
from kvlib.timing import StepTimer, time_fn

from . import plots, say
from .rounds import disturbed, flag_label, report, rounds, timed


@dataclass
class Fit:
    """A measurement's sizes, its rounds, the fitted coefficients (seconds), what is wrong with it
    (empty when nothing), and its figure."""

    sizes: list
    samples: dict
    coef: list
    problems: list
    fig: Figure


def problems(samples: dict, monotonic: bool = True) -> list[str]:
    """What cannot be right in ``{size: [seconds]}``: rounds of one size too far apart (a busy
    machine: :mod:`course.rounds`), or a larger size whose best beats a smaller one's by over a
    quarter (more work cannot take less time)."""
    found = disturbed({f"size {n} (ms)": [x * 1e3 for x in s] for n, s in samples.items()})
    sizes = list(samples)
    for small, big in zip(sizes, sizes[1:]) if monotonic else ():
        if 1.25 * min(samples[big]) < min(samples[small]):
            found.append(f"size {big} ran faster than size {small}")
    return found


def fit(xs, ys, powers) -> list[float]:
    """Least squares ``ys = sum_k c_k * xs**powers[k]``: the coefficients ``[c_k]``."""
    X = torch.tensor([[float(x) ** p for p in powers] for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(X, y).solution.squeeze(1).tolist()


def _limits(*axes):  # times and sizes start at zero
    for ax in axes:
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)


def _steps(model, lengths, rounds_n):
    """Rounds of one no-cache step (a forward over S random tokens, then the argmax) per S."""
    gen = torch.Generator().manual_seed(0)
    ids = {S: torch.randint(0, model.config.vocab_size, (1, S), generator=gen).to(model.device)
           for S in lengths}

    def step(S):
        return model(ids[S], use_cache=False).logits[:, -1].argmax(-1)
    with torch.no_grad():
        samples = rounds({S: timed(partial(step, S), model.device) for S in lengths}, rounds_n, 1)
    return {S: s for S, s in samples.items() if s}  # a size out of memory in every round: dropped


def step_times(model, lengths, label: str, rounds_n: int = 3) -> Fit:
    """Measurement 1: a no-cache step of the course model against S, and the line a + b·S."""
    samples = _steps(model, lengths, rounds_n)
    sizes = list(samples)
    best = [min(samples[S]) for S in sizes]
    a, b = fit(sizes, best, [0, 1])
    off = max(abs(m / (a + b * S) - 1) for S, m in zip(sizes, best))
    found = problems(samples)
    if a < 0 or b <= 0:  # a fixed cost and a cost per token: neither can be below zero
        found.append(f"the fit gives a = {a * 1e3:.1f} ms, b = {b * 1e3:.3f} ms, not both above 0")
    fig, ax = plots.figure("One no-cache step: time against length", flag_label(label, found),
                           "S: tokens in the forward", "ms / step")
    ax.errorbar(sizes, [m * 1e3 for m in best], fmt="o", capsize=3, zorder=3,
                yerr=[[0] * len(sizes), [(max(samples[S]) - m) * 1e3 for S, m in zip(sizes, best)]],
                label="measured: best round, bar up to the worst")
    dense = range(0, sizes[-1] + 1, max(1, sizes[-1] // 100))
    ax.plot(dense, [(a + b * S) * 1e3 for S in dense], "--", color="0.3", label="fit: a + b·S")
    _limits(ax)
    plots.save(fig, "nb01_time_per_step", label=flag_label(label, found), data={
        "lengths": sizes, "samples_s": [samples[S] for S in sizes], "fit_ab": [a, b],
        "problems": found})
    report(f"S = {sizes[0]} to {sizes[-1]}: best step {best[0] * 1e3:.0f} to "
           f"{best[-1] * 1e3:.0f} ms, "
           f"{best[-1] / best[0]:.1f}x; the line a + b·S has a = {a * 1e3:.1f} ms, "
           f"b = {b * 1e3:.3f} ms a token, and misses a length by at most {off:.0%}", found)
    return Fit(sizes, samples, [a, b], found, fig)


def square_term(model, lengths, label: str, s_star: float, rounds_n: int = 3) -> Fit:
    """Measurement 2: the tiny model past its S*, fitted with a + b·S + c·S²."""
    samples = _steps(model, lengths, rounds_n)
    sizes = list(samples)
    best = [min(samples[S]) for S in sizes]
    a, b, c = fit(sizes, best, [0, 1, 2])
    found = problems(samples)
    if b <= 0 or c <= 0:  # each term is work that grows with S: it can only add time
        found.append(f"the fit gives b = {b * 1e6:.3f} us, c = {c * 1e9:.4f} ns, not both above 0")
    per_token = [m / S for S, m in zip(sizes, best)]
    low = min(range(len(sizes) - 1), key=per_token.__getitem__)
    fig, (ax1, ax2) = plots.figure("The tiny model: a no-cache step against S, and the fit "
                                   "a + b·S + c·S²", flag_label(label, found),
                                   "S: tokens in the forward", size=(10, 4), panels=2)
    dense = list(range(sizes[0], sizes[-1] + 1, max(1, sizes[-1] // 300)))
    ax1.plot(sizes, [m * 1e3 for m in best], "o", zorder=3, label="measured: best round")
    ax1.plot(dense, [(a + b * S + c * S * S) * 1e3 for S in dense], "--", color="0.3",
             label=f"fit: a + b·S + c·S² on S = {sizes[0]:,} to {sizes[-1]:,}")
    ax1.plot(dense, [(a + b * S) * 1e3 for S in dense], ":", color="0.5", label="its a + b·S alone")
    ax1.set(ylabel="ms / step", title="time per step")
    ax2.plot(sizes, [p * 1e6 for p in per_token], "o-", label="measured: best round / S")
    ax2.plot(dense, [(a / S + b + c * S) * 1e6 for S in dense], "--", color="0.3", label="fit / S")
    ax2.plot(dense, [(a / S + b) * 1e6 for S in dense], ":", color="0.5",
             label="the fit without its S² term")
    ax2.set(ylabel="µs per token re-run", title="time per token re-run")
    _limits(ax1, ax2)
    plots.save(fig, "nb01_quadratic", label=flag_label(label, found), data={
        "lengths": sizes, "samples_s": [samples[S] for S in sizes], "fit_abc": [a, b, c],
        "problems": found})
    report(f"time per token re-run: {per_token[low] * 1e6:.0f} → {per_token[-1] * 1e6:.0f} µs "
           f"from S = {sizes[low]:,} to {sizes[-1]:,} ({per_token[-1] / per_token[low]:.1f}x); at "
           f"S = {sizes[-1]:,} the fitted S² term is {c * sizes[-1] ** 2 / best[-1]:.0%} of the "
           f"step; fitted crossover b / c = {f'{b / c:,.0f}' if b > 0 and c > 0 else 'none'} "
           f"tokens (the FLOP count's S* = {s_star:,.0f}, or {2 * s_star:,.0f} if the kernel "
           "skips the upper half)", found)
    return Fit(sizes, samples, [a, b, c], found, fig)


def whole_generation(decode, model, n: int, coef, label: str) -> Figure:
    """The tiny model generates ``n`` tokens from a 1-token prompt with ``decode`` (no cache) and
    with ``kvlib.generate`` (a cache); the prediction sums the fit ``coef`` = (a, b, c) over the
    steps. The figure the notebook opens with."""
    start = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    timer = StepTimer(model.device)
    no_cache_tokens = decode(model, start, n, timer)
    no_cache = timer.times_s                                  # step i ran over S = i + 1 tokens
    cached = kvlib.generate(model, start, n, timed=True, eos_token_id=None)
    with_cache = [cached.prefill_s] + cached.step_s           # each produced one token
    a, b, c = coef
    predicted = [a + b * S + c * S * S for S in range(1, n + 1)]
    half = n // 2
    bend = {name: sum(s[half:]) / sum(s[:half])
            for name, s in (("no cache", no_cache), ("cache", with_cache))}
    found = [why for bad, why in (
        (bend["no cache"] < 1, "the no-cache second half, over longer forwards, took less time"),
        (sum(with_cache) > sum(no_cache), "the loop with a cache took longer in all")) if bad]
    fig, (ax1, ax2) = plots.figure(f"Generating {n:,} tokens from a 1-token prompt (the tiny "
                                   "model)", flag_label(label, found), "tokens generated",
                                   size=(10, 4), panels=2)
    steps = range(1, n + 1)
    for ax, f in ((ax1, lambda s: [x * 1e3 for x in s]), (ax2, lambda s: list(accumulate(s)))):
        ax.plot(steps, f(no_cache), color="tab:red", lw=0.8, label="no cache (re-run the prefix)")
        ax.plot(steps, f(predicted), "--", color="0.3", label="predicted: the fit a + b·S + c·S²")
        ax.plot(steps, f(with_cache), color="tab:blue", lw=0.8, label="kvlib.generate (a cache)")
    ax1.set(ylabel="ms for this token", title="each step")
    ax2.set(ylabel="seconds", title="cumulative")
    _limits(ax1, ax2)
    plots.save(fig, "nb01_cumulative_time", label=flag_label(label, found), data={
        "n_tokens": n, "no_cache_steps_s": no_cache, "cached_steps_s": with_cache,
        "fit_abc": list(coef), "problems": found})
    report(f"{n:,} tokens: no cache {sum(no_cache):.1f} s (the fit predicted "
           f"{sum(predicted):.1f} s), with a cache {sum(with_cache):.1f} s; second half over "
           f"first: no cache {bend['no cache']:.1f}x, with a cache {bend['cache']:.1f}x; same "
           "tokens: " + next((f"the first {i:,}, then they part" for i, (x, y) in
                 enumerate(zip(cached.tokens, no_cache_tokens)) if x != y), f"all {n:,}"), found)
    return fig


def answer(name: str = "nb01_cumulative_time") -> Image:
    """The committed reference figure the notebook opens with, and its totals, with its label."""
    data, label = plots.load(name)
    totals = [sum(data[k]) for k in ("no_cache_steps_s", "cached_steps_s")]
    say(f"REFERENCE, figures/{name}.png ({label}): {data['n_tokens']:,} tokens, no cache "
          f"{totals[0]:.1f} s, with a cache {totals[1]:.1f} s")
    return Image(filename=str(plots.FIGURES / f"{name}.png"))


def roofs(device, dtype, size: int) -> tuple[float, float]:
    """This device's two roofs: FLOP/s of a ``size``² matmul in ``dtype`` (median of 5), and the
    bandwidth of a large copy (``kvlib.bandwidth``)."""
    x = torch.randn(size, size, device=device, dtype=dtype)
    peak = 2 * size**3 / time_fn(lambda: x @ x, device=device, warmup=2, repeats=5).median_s
    bandwidth = measure_bandwidth(device)
    say(f"peak {peak / 1e9:,.0f} GFLOP/s ({size}x{size} matmul, {str(dtype)[6:]}), bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (copy): ridge at {peak / bandwidth:.1f} FLOP per byte")
    return peak, bandwidth


def roofline(model, ns, peak: float, bandwidth: float, flops, label: str) -> Figure:
    """Prefills of ``n`` tokens from an empty cache with ``kvlib.forward`` (``n = 1`` is a decode
    step's work), then decode steps just after the longest; ``flops(config, n, S)`` counts a
    forward's FLOPs. Prints TTFT and TPOT and the share of the peak each prefill reached."""
    config, dtype, device = model.config, model.dtype, model.device
    cache = kvlib.KVCache.for_model(config, max(ns) + 1, device=device, dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (1, max(ns) + 1),
                        generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        samples = rounds({n: timed(partial(kvlib.forward, model, ids[:, :n], cache, 0), device)
                          for n in ns}, 3, 1)
    big = max(samples)
    with torch.no_grad():
        kvlib.forward(model, ids[:, :big], cache, 0)           # fill, then decode after it
        tpot = time_fn(lambda: kvlib.forward(model, ids[:, big:big + 1], cache, big),
                       device=device, warmup=1, repeats=5).median_s
    found = problems(samples)
    points = {n: (flops(config, n, n) / decode_bytes(config, dtype, n),
                  flops(config, n, n) / min(s)) for n, s in samples.items()}
    ridge = peak / bandwidth
    fig, ax = plots.figure("Roofline: a decode step and prefills of n tokens",
                           flag_label(label, found), "arithmetic intensity (FLOP per byte moved)",
                           "achieved GFLOP/s", size=(7, 4.4))
    xs = sorted([min(x for x, _ in points.values()) / 4, ridge,
                 4 * max(x for x, _ in points.values())])
    ax.plot(xs, [min(peak, bandwidth * x) / 1e9 for x in xs], color="0.3",
            label=f"roof: min(peak {peak / 1e9:,.0f} GFLOP/s, "
                  f"{bandwidth / 1e9:.0f} GB/s × intensity)")
    ax.axvline(ridge, color="0.6", ls=":", lw=1, label=f"ridge: {ridge:.1f} FLOP/B")
    ax.plot([x for x, _ in points.values()], [r / 1e9 for _, r in points.values()], "o",
            color="tab:blue", label="measured forward")
    for n, (x, r) in points.items():
        ax.annotate("decode step" if n == 1 else f"n={n}", (x, r / 1e9),
                    textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set(xscale="log", yscale="log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain), ax.yaxis.set_major_formatter(plain)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    plots.save(fig, "nb01_roofline", label=flag_label(label, found), data={
        "n": list(samples), "prefill_s": list(samples.values()), "peak_flops": peak,
        "bandwidth": bandwidth, "tpot_s": tpot, "problems": found})
    ttft, moved = min(samples[big]), decode_bytes(config, dtype, big + 1)
    report(f"TTFT of a {big}-token prompt {ttft * 1e3:.0f} ms ({ttft / big * 1e3:.2f} ms a "
           f"token), TPOT after it {tpot * 1e3:.1f} ms: {tpot / (ttft / big):.0f}x a prefilled "
           f"token; bytes ÷ bandwidth predicts {moved / bandwidth * 1e3:.1f} ms: the step reads at "
           f"{moved / tpot / 1e9:.1f} GB/s, {moved / tpot / bandwidth:.0%} of the copy's; share "
           "of the peak: " + ", ".join(f"n={n} {r / peak:.0%}" for n, (_, r) in points.items()),
           found)
    return fig
