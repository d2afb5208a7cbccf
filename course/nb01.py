"""Notebook 01's measuring machinery (no cache): the no-cache step and its fit, the whole
generation, the roofline, and where one decode step's time goes. Each public function is one
cell: it measures, prints one line and returns what the next cell needs. Timing goes through
:mod:`course.rounds`; a run whose numbers cannot be right (:func:`problems`) says so once, in
its line and its figure's label.
"""

from functools import partial
from itertools import accumulate

import torch
from IPython.display import Image
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
    found = disturbed({f"size {n} (ms)": [x * 1e3 for x in s] for n, s in samples.items()})
    sizes = list(samples)
    return found + [f"size {big} ran faster than size {small}" for small, big in
                    zip(sizes, sizes[1:]) if 1.25 * min(samples[big]) < min(samples[small])]


def _limits(*axes):  # times and sizes start at zero
    for ax in axes:
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)


def no_cache_steps(model, lengths, label: str, s_star: float | None = None, rounds_n: int = 3):
    """A no-cache step (a forward over S random tokens, then the argmax) at each of ``lengths``,
    in rounds, fitted to each S's best with a + b·S, or with a + b·S + c·S² when ``s_star`` (the
    FLOP count's crossover) is given. A fitted term that grows with S is work: at or below zero
    it flags the run. Draws the time per step and per token re-run; returns the fit and figure."""
    gen = torch.Generator().manual_seed(0)
    ids = {S: torch.randint(0, model.config.vocab_size, (1, S), generator=gen).to(model.device)
           for S in lengths}

    def step(S):
        return model(ids[S], use_cache=False).logits[:, -1].argmax(-1)
    with torch.no_grad():
        samples = rounds({S: timed(partial(step, S), model.device) for S in lengths}, rounds_n, 1)
    samples = {S: s for S, s in samples.items() if s}  # out of memory in every round: dropped
    sizes, best = list(samples), [min(s) for s in samples.values()]
    powers = [0, 1] if s_star is None else [0, 1, 2]
    X = torch.tensor([[float(S) ** p for p in powers] for S in sizes], dtype=torch.float64)
    coef = torch.linalg.lstsq(X, torch.tensor(best, dtype=torch.float64)[:, None]).solution
    coef = coef[:, 0].tolist()

    def fitted(S, k=None):  # the fit's first k terms (all: None) at S, in seconds
        return sum(c * S**p for p, c in zip(powers[:k], coef))
    found = problems(samples) + [f"the fit's S^{p} term is {c:.3g} s, not above 0"
                                 for p, c in zip(powers, coef) if p and c <= 0]
    shown, terms = flag_label(label, found), " + ".join(["a", "b·S", "c·S²"][:len(powers)])
    fig, axes = plots.figure(f"A no-cache step against S, and the fit {terms}", shown,
                             "S: tokens in the forward", size=(10, 4), panels=2)
    dense = range(sizes[0], sizes[-1] + 1, max(1, sizes[-1] // 300))
    fits = [(len(powers), "--", "0.3", f"fit: {terms}")]
    if s_star is not None:
        fits.append((2, ":", "0.6", "the fit without its S² term"))
    for ax, per_S, scale, what in ((axes[0], False, 1e3, "ms / step"),
                                   (axes[1], True, 1e6, "µs per token re-run")):
        ax.plot(sizes, [m * scale / (S if per_S else 1) for S, m in zip(sizes, best)], "o",
                zorder=3, label="measured: the best round")
        for k, style, color, name in fits:  # k: the fit's first k terms
            ax.plot(dense, [fitted(S, k) * scale / (S if per_S else 1) for S in dense], style,
                    color=color, label=name)
        ax.set(ylabel=what)
    _limits(*axes)
    plots.save(fig, "nb01_time_per_step" if s_star is None else "nb01_quadratic",
               {"lengths": sizes, "samples_s": list(samples.values()), "fit": coef,
                "problems": found}, shown)
    per_token = [m / S for S, m in zip(sizes, best)]
    off = max(abs(m / fitted(S) - 1) for S, m in zip(sizes, best))
    a, b, c = coef + [0] * (3 - len(coef))
    report(f"S = {sizes[0]:,} to {sizes[-1]:,}: best step {best[0] * 1e3:.1f} to "
           f"{best[-1] * 1e3:.1f} ms, per token re-run {per_token[0] * 1e6:,.0f} → "
           f"{per_token[-1] * 1e6:,.0f} µs; fit a = {a * 1e3:.1f} ms, b = {b * 1e6:,.1f} µs a "
           f"token, missing a length by at most {off:.0%}" + ("" if s_star is None else
           f"; at S = {sizes[-1]:,} the S² term is {c * sizes[-1] ** 2 / best[-1]:.0%} of the "
           f"step; crossover b / c = {f'{b / c:,.0f}' if b > 0 and c > 0 else 'none'} tokens "
           f"(the FLOP count's S* = {s_star:,.0f}, or {2 * s_star:,.0f} if the kernel skips the "
           "upper half)"), found)
    return coef, fig


def whole_generation(decode, model, n: int, coef, label: str):
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
    bend = [sum(s[n // 2:]) / sum(s[:n // 2]) for s in (no_cache, with_cache)]
    found = [why for bad, why in (
        (bend[0] < 1, "the no-cache second half, over longer forwards, took less time"),
        (sum(with_cache) > sum(no_cache), "the loop with a cache took longer in all")) if bad]
    shown = flag_label(label, found)
    fig, axes = plots.figure(f"Generating {n:,} tokens from a 1-token prompt (the tiny model)",
                             shown, "tokens generated", size=(10, 4), panels=2)
    for ax, f, what in ((axes[0], lambda s: [x * 1e3 for x in s], "ms for this token"),
                        (axes[1], lambda s: list(accumulate(s)), "seconds, cumulative")):
        for s, style, color, name in (
                (no_cache, "-", "tab:red", "no cache (re-run the prefix)"),
                (predicted, "--", "0.3", "predicted: the fit a + b·S + c·S²"),
                (with_cache, "-", "tab:blue", "kvlib.generate (a cache)")):
            ax.plot(range(1, n + 1), f(s), style, color=color, lw=1, label=name)
        ax.set(ylabel=what)
    _limits(*axes)
    plots.save(fig, "nb01_cumulative_time", {
        "n_tokens": n, "no_cache_steps_s": no_cache, "cached_steps_s": with_cache,
        "fit_abc": list(coef), "problems": found}, shown)
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
    """This device's two roofs: FLOP/s of a ``size``² matmul in ``dtype`` (the best of 5
    rounds), and the bandwidth of a large copy (``kvlib.bandwidth``)."""
    x = torch.randn(size, size, device=device, dtype=dtype)
    peak = 2 * size**3 / min(rounds({"matmul": timed(lambda: x @ x, device)}, 5, 2)["matmul"])
    bandwidth = measure_bandwidth(device)
    say(f"peak {peak / 1e9:,.0f} GFLOP/s ({size}x{size} matmul, {str(dtype)[6:]}), bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (copy): ridge at {peak / bandwidth:.1f} FLOP per byte")
    return peak, bandwidth


def roofline(model, ns, peak: float, bandwidth: float, flops, label: str):
    """Prefills of ``n`` tokens from an empty cache with ``kvlib.forward`` (``n = 1`` is a decode
    step's work) and a decode step after the longest, taking turns in rounds; ``flops(config, n,
    S)`` counts a forward's FLOPs. Prints TTFT, TPOT and the share of the peak each reached."""
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
    tpot, ridge = min(decode), peak / bandwidth
    points = {n: (flops(config, n, n) / decode_bytes(config, dtype, n),
                  flops(config, n, n) / min(s)) for n, s in samples.items()}
    shown = flag_label(label, found)
    fig, ax = plots.figure("Roofline: a decode step and prefills of n tokens", shown,
                           "arithmetic intensity (FLOP per byte moved)", "achieved GFLOP/s",
                           size=(7, 4.4))
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
    ax.legend(fontsize=8, loc="lower right")
    plots.save(fig, "nb01_roofline", {"n": list(samples), "prefill_s": list(samples.values()),
                                      "peak_flops": peak, "bandwidth": bandwidth, "tpot_s": tpot,
                                      "problems": found}, shown)
    ttft, moved = min(samples[big]), decode_bytes(config, dtype, big + 1)
    report(f"TTFT of a {big}-token prompt {ttft * 1e3:.0f} ms ({ttft / big * 1e3:.2f} ms a "
           f"token), TPOT after it {tpot * 1e3:.1f} ms: {tpot / (ttft / big):.0f}x a prefilled "
           f"token; bytes ÷ bandwidth predicts {moved / bandwidth * 1e3:.1f} ms: the step reads at "
           f"{moved / tpot / 1e9:.1f} GB/s, {moved / tpot / bandwidth:.0%} of the copy's; share "
           "of the peak: " + ", ".join(f"n={n} {r / peak:.0%}" for n, (_, r) in points.items()),
           found)
    return fig


def cpu_decode_step(model, context: int):
    """One decode step of SmolLM2-135M in fp32 on the CPU, as a call (``model`` itself on a CPU,
    else loaded there): its cache prefilled to ``context`` tokens and two steps run first, so the
    call is a warm one. Under a profiler the call is one region, :data:`OUTSIDE`, whose own time
    is what ran between the aten ops (Python, module calls, the profiler's own bookkeeping)."""
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
    products, which read the weights (at what rate), against the other aten op calls (how many, how
    long each on average). Returns the ops, the largest first."""
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
