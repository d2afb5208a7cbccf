"""Notebook 00's measuring machinery (setup and instruments): the warm-up and clock
demonstrations, the committed GPU reference read back with its label, and the budget figure. Each
function is one cell: it measures or reads, prints one line, and returns a figure where there is
one; the notebook keeps what it teaches (the dtype rule, the meter, the bytes of a token, the plan).
"""

import statistics
import time
from functools import partial

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvlib.budget import plan_budget
from kvlib.config import GIB, MIB, load_config
from kvlib.timing import time_fn

from . import plots, say
from .quantities import reached
from .rounds import FLAG, SPREAD, rounds, shown, timed

REFERENCE = "REFERENCE, not this run"
COMPUTED = "computed from the shipped configs (kvlib.budget.plan_budget), the same on every device"


def warmup(fn, device, label: str, calls: int = 12) -> Figure:
    """``calls`` timed calls of ``fn`` with no warm-up (the first pays the start-up), then
    ``calls`` more the way ``time_fn`` usually runs (2 warm-up calls first). A cold call counts as
    slow only more than 10% above the warm p90 (the dotted line), clear of the warm calls' own
    scatter. When the warm calls themselves scatter (p90 over ``SPREAD`` times their median),
    other work shared the machine and no start-up cost is read off them: the line says so."""
    cold = time_fn(fn, device=device, warmup=0, repeats=calls)
    warm = time_fn(fn, device=device, warmup=2, repeats=calls)
    slow, busy = 1.1 * warm.p90_s, warm.p90_s > SPREAD * warm.median_s
    label = f"{label} · {FLAG}: the warm calls scattered" if busy else label
    fig, ax = plots.figure("Timing one call: cold calls and warmed-up calls", label, "call number",
                           "ms per call (log scale)", size=(9.5, 3.8))
    for run, style, name in ((cold, "o-", "no warm-up (cold run)"),
                             (warm, "s-", "after 2 warm-up calls")):
        ax.plot(range(1, calls + 1), [s * 1e3 for s in run.samples_s], style, label=name)
    ax.axhspan(warm.p10_s * 1e3, warm.p90_s * 1e3, color="tab:orange", alpha=0.15,
               label="warm p10–p90")
    ax.axhline(slow * 1e3, color="0.3", lw=1, ls=":", label="warm p90 + 10%: above it, slow")
    ax.set_yscale("log")  # a GPU's first call can be 100x the rest: ticks that read as numbers
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 1.5, 2, 3, 5, 7)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plots.save(fig, "nb00_timing_warmup", {"cold_s": cold.samples_s, "warm_s": warm.samples_s},
               label)
    first = cold.samples_s[0] / statistics.median(cold.samples_s[1:])
    verdict = ("the warm calls scattered (another program shared the machine): no start-up cost "
               "read" if busy else f"{sum(s > slow for s in cold.samples_s)} of {calls} cold calls "
               "above the dotted line (warm p90 + 10%)")
    say(f"first call {cold.samples_s[0] * 1e3:.3f} ms, {first:.1f}x the cold calls after it; "
        f"time_fn after 2 warm-ups: {warm}; {verdict}")
    return fig


def clocks(fn, device, rounds_n: int = 15) -> None:
    """The same call timed three ways, taking turns in rounds (:mod:`course.rounds`):
    ``perf_counter`` alone, ``perf_counter`` after a synchronise, and ``time_fn``. On a GPU the
    first times only the queueing."""
    gpu = torch.device(device).type == "cuda"

    def host(sync):  # queued work from before is finished first: it must not count
        if gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if sync and gpu:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    ms = rounds({"no sync": partial(host, False), "sync": partial(host, True),
                 "time_fn": lambda: timed(fn, device)() * 1e3}, rounds_n, warmup=1)
    say(f"medians of {rounds_n} rounds (min..max), ms: perf_counter alone "
        f"{shown(ms['no sync'], '.3f')}, with a synchronise {shown(ms['sync'], '.3f')}, time_fn "
        f"{shown(ms['time_fn'], '.3f')}"
        + ("" if gpu else " (a CPU call is synchronous: the three time the same work)"))


def held_back() -> None:
    """The committed GPU timeline run's reserved - allocated at every decode step: the allocator's
    cache. Which steps, said in the line: notebooks 02 and 03 show other runs (the longest-context
    runs' prefill chunks), whose gaps differ."""
    ref = plots.gpu_reference("gpu_timeline")
    if ref is None:
        print("no GPU run committed in figures/: no reference to show")
        return
    data, label, _ = ref
    rows = [r for rows in data["rows"].values() for r in rows]
    gaps, tokens = [r["reserved"] - r["allocated"] for r in rows], [r["tokens"] for r in rows]
    say(f"{REFERENCE}: {label}: in its timeline run, decode steps from token {min(tokens):,} to "
        f"{max(tokens):,}, reserved stayed {min(gaps) / MIB:.0f}–{max(gaps) / MIB:.0f} MiB above "
        f"allocated at every step, for both caches ({', '.join(data['rows'])})")


def context_vs_budget(budget) -> Figure:
    """The longest context against the memory budget, 8 to 24 GiB, for the 3-4B configs in bf16
    and Qwen3-4B in fp32 (drawn from where its weights fit); each model's trained context dotted;
    ``budget`` marked at 12 GiB. The y axis stops at 200K, where the lesson is."""
    gib = list(range(8, 25))
    colors = {"qwen3-4b": "tab:blue", "llama-3.2-3b": "tab:orange", "qwen2.5-3b": "tab:green"}
    series = {f"{name} {'fp32' if dt == torch.float32 else 'bf16 / fp16'}":
              [plan_budget(load_config(name), dt, g * GIB).max_context for g in gib]
              for name, dt in [(n, torch.bfloat16) for n in colors] + [("qwen3-4b", torch.float32)]}
    fig, ax = plots.figure("Longest context that fits a memory budget", COMPUTED,
                           "memory budget (GiB)", "longest context (thousands of tokens)",
                           size=(9.5, 4.6))
    for key, contexts in series.items():
        name = key.split()[0]
        drawn = [(g, c / 1000) for g, c in zip(gib, contexts) if c > 0]  # where the weights fit
        ax.plot(*zip(*drawn), "--" if "fp32" in key else "-",
                color=colors[name], lw=2.2 if name == "qwen3-4b" else 1.4, label=key)
    for name, color in colors.items():
        trained = load_config(name).max_position_embeddings
        ax.axhline(trained / 1000, color=color, lw=1.2, ls=":",
                   label=f"{name}: trained for {trained:,}")
    ax.axvline(12, color="crimson", lw=1, label="the course's 12 GiB budget")
    ax.plot([12], [budget.max_context / 1000], "o", color="tab:blue")
    ax.annotate(f"{budget.max_context:,}", (12, budget.max_context / 1000), xytext=(-6, 6),
                textcoords="offset points", ha="right", color="tab:blue", fontsize=8)
    ax.set(xlim=(gib[0], gib[-1]), ylim=(0, 200))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plots.save(fig, "nb00_context_vs_budget", data={"budget_gib": gib, **series}, label=COMPUTED)
    return fig


def h200_longest(budget) -> None:
    """The committed GPU check's longest context against the plan for the loop it ran, and where
    its 12 GiB went that a plan does not price (``budget`` gives the weights and this plan)."""
    ref = plots.gpu_reference("gpu_longest")
    if ref is None:
        print("no GPU run committed in figures/: the plan stays a prediction on a real card")
        return
    data, label, _ = ref
    reached_at = data["prealloc"]
    fit = next(t for t in data["tries"]["prealloc"] if t["tokens"] == reached_at and t["fits"])
    held = fit["allocated_before"] - budget.weights
    slack = fit["peak_reserved"] - fit["peak_allocated"]
    say(f"{REFERENCE}: {label}: {reached(data)}; that plan is shorter than this one "
        f"({budget.max_context:,}) because that run's prefill built an attention mask as long as "
        f"the context, a larger workspace; not in a plan: {held / MIB:.0f} MiB held beyond the "
        f"weights before the run, and {slack / MIB:.0f} MiB reserved by the allocator above what "
        "tensors held at its peak")
