"""Notebook 00's machinery, one cell a function: the warm-up and clock demonstrations, the committed
GPU reference read back with its label, the budget figure. The notebook keeps what it teaches."""

import statistics
import time
from functools import partial

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator

from kvlib.budget import plan_budget
from kvlib.config import GIB, MIB, load_config
from kvlib.timing import time_fn

from . import plots, say
from .quantities import reached
from .rounds import FLAG, SPREAD, rounds, shown, timed

REFERENCE = "REFERENCE, not this run"
H200_RUNS = plots.FIGURES / "h200"  # the committed GPU check's runs
COMPUTED = "computed from the shipped configs (kvlib.budget.plan_budget), the same on every device"


def warmup(fn, device, label: str, calls: int = 12) -> Figure:
    """``calls`` calls of ``fn`` with no warm-up (the first pays the start-up), then ``calls`` after
    2 warm-up calls. A cold call is slow only 10% above the warm p90, clear of the warm scatter;
    warm calls with a p90 over ``SPREAD`` times their median mean other work shared the machine."""
    cold, warm = (time_fn(fn, device=device, warmup=w, repeats=calls) for w in (0, 2))
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
    ax.yaxis.set_major_formatter("{x:g}")
    ax.yaxis.set_minor_formatter("")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plots.save(fig, "nb00_timing_warmup", {"cold_s": cold.samples_s, "warm_s": warm.samples_s},
               label)
    verdict = ("the warm calls scattered (another program shared the machine): no start-up cost "
               "read" if busy else f"{sum(s > slow for s in cold.samples_s)} of {calls} cold calls "
               "above the dotted line (warm p90 + 10%)")
    first = cold.samples_s[0] / statistics.median(cold.samples_s[1:])
    say(f"first call {cold.samples_s[0] * 1e3:.3f} ms, {first:.1f}x the cold calls after it; "
        f"time_fn after 2 warm-ups: {warm}; {verdict}")
    return fig


def clocks(fn, device, rounds_n: int = 15) -> None:
    """The same call timed three ways in rounds: ``perf_counter`` alone, then with a synchronise,
    and ``time_fn``. On a GPU the first times only the queueing."""
    gpu = torch.device(device).type == "cuda"
    sync = partial(torch.cuda.synchronize, device) if gpu else lambda: None

    def host(after: bool):  # queued work from before is finished first: it must not count
        sync()
        start = time.perf_counter()
        fn()
        if after:
            sync()
        return (time.perf_counter() - start) * 1e3

    ms = {k: shown(v, ".3f") for k, v in rounds({"no sync": partial(host, False), "sync": partial(
        host, True), "time_fn": lambda: timed(fn, device)() * 1e3}, rounds_n, warmup=1).items()}
    say(f"medians of {rounds_n} rounds (min..max), ms: perf_counter alone {ms['no sync']}, with a "
        f"synchronise {ms['sync']}, time_fn {ms['time_fn']}"
        + ("" if gpu else " (a CPU call is synchronous: the three time the same work)"))


def held_back() -> None:
    """The committed GPU timeline run's reserved - allocated at every decode step: the allocator's
    cache. The line names the steps: notebooks 02 and 03 show other runs, whose gaps differ."""
    data, label = plots.load("gpu_timeline", H200_RUNS)
    rows = [r for rows in data["rows"].values() for r in rows]
    gaps, tokens = [r["reserved"] - r["allocated"] for r in rows], [r["tokens"] for r in rows]
    say(f"{REFERENCE}: {label}: in its timeline run, decode steps from token {min(tokens):,} to "
        f"{max(tokens):,}, reserved stayed {min(gaps) / MIB:.0f}–{max(gaps) / MIB:.0f} MiB above "
        f"allocated at every step, for both caches ({', '.join(data['rows'])})")


def context_vs_budget(budget) -> Figure:
    """The longest context against the memory budget, 8 to 24 GiB, for the 3-4B configs in bf16
    and Qwen3-4B in fp32; trained contexts dotted; the y axis stops at 200K, where the lesson is."""
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
        if "fp32" not in key:  # each model's trained context, once
            trained = load_config(name).max_position_embeddings
            ax.axhline(trained / 1000, color=colors[name], lw=1.2, ls=":",
                       label=f"{name}: trained for {trained:,}")
    ax.axvline(12, color="crimson", lw=1, label="the course's 12 GiB budget")
    ax.plot([12], [budget.max_context / 1000], "o", color="tab:blue",
            label=f"qwen3-4b bf16 on 12 GiB: {budget.max_context:,}")
    ax.set(xlim=(gib[0], gib[-1]), ylim=(0, 200))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plots.save(fig, "nb00_context_vs_budget", data={"budget_gib": gib, **series}, label=COMPUTED)
    return fig


def h200_longest(budget) -> None:
    """The committed GPU check's longest context against the plan for the loop it ran, and where
    its 12 GiB went that a plan does not price (``budget`` gives the weights and this plan)."""
    data, label = plots.load("gpu_longest", H200_RUNS)
    tries = data["tries"]["prealloc"]
    fit = next(t for t in tries if t["tokens"] == data["prealloc"] and t["fits"])
    say(f"{REFERENCE}: {label}: {reached(data)}; that plan is shorter than this one "
        f"({budget.max_context:,}) because that run's prefill built an attention mask as long as "
        "the context, a larger workspace; not in a plan: "
        f"{(fit['allocated_before'] - budget.weights) / MIB:.0f} MiB held beyond the weights "
        f"before the run, and {(fit['peak_reserved'] - fit['peak_allocated']) / MIB:.0f} MiB "
        "reserved by the allocator above what tensors held at its peak")
