"""Notebook 03's machinery, one call per cell: the opening figure, the drawn slots, every cache's
time per decode step against the context, and on a GPU both caches on the card."""

import statistics
import textwrap
from functools import partial

import torch
from IPython.display import Image
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

import kvlib
from course.simulate import simulate
from kvlib.budget import plan_budget
from kvlib.config import GIB, MIB
from kvlib.memory import allocator_budget, free

from . import bench, plots, say
from .nb02 import big_card, card_run  # noqa: F401 (big_card: the notebook's lab.big_card)
from .quantities import reference_caches, short_of, simulated_longest
from .rounds import disturbed, flag_label, report, rounds, shown

COLORS = plots.CACHE_COLORS


def answer_figure(qwen, card, context: int):
    """Both caches run to ``context`` tokens on the simulated card (every chunk and step: exact
    tensor bytes), beside the H200 reference's reserved-above-allocated for each."""
    sims = {kind: simulate(qwen, context, cache=kind, card=card) for kind in ("prealloc", "cat")}
    label = (f"simulated {card.memory / GIB:g} GiB card (meta device: exact tensor bytes; "
             f"no allocator) · Qwen3-4B {str(qwen.dtype).removeprefix('torch.')}")
    fig, (left, right) = plots.figure("The preallocated cache against the cat cache on a 12 GiB "
                                      "card", size=(12, 4.6), panels=2)
    cat, budget, pre = sims["cat"], card.memory / GIB, sims["prealloc"]
    near = pre.timeline["tokens"][-1] - 2048  # the zoom: the end, where the lines nearly touch
    zoom = left.inset_axes([0.06, 0.5, 0.38, 0.25])
    for ax in (left, zoom):
        for kind, run in sims.items():
            rows = [i for i, t in enumerate(run.timeline["tokens"]) if ax is left or t >= near]
            for key, style, what in (("live", "-", "held between steps"),
                                     ("peak", ":", "peak during the chunk")):
                ax.plot([run.timeline["tokens"][i] / 1000 for i in rows],
                        [run.timeline[key][i] / GIB for i in rows], style, color=COLORS[kind],
                        label=f"{kind}: {what}")
        if not cat.fits:  # where the cat cache's next copy asked for more than the budget
            ax.plot(cat.timeline["tokens"][-1] / 1000, cat.timeline["peak"][-1] / GIB, "x",
                    color=COLORS["cat"], ms=12, mew=2.5, label="cat: out of memory")
        ax.axhline(budget, color="black", lw=1.5, ls="--", label=f"budget {budget:g} GiB")
    left.set(xlabel="thousands of tokens held", ylabel="GiB", ylim=(7, budget * 1.025))
    left.set_title(textwrap.fill(label, 80), fontsize=8)
    left.legend(fontsize=7, loc="lower right")
    zoom.set_ylim(budget - 0.06, budget + 0.005)
    zoom.set_title(f"zoom: prealloc peaks at {pre.peak / MIB:,.1f} of "
                   f"{card.memory / MIB:,.0f} MiB", fontsize=7)
    zoom.tick_params(labelsize=6)
    ref = plots.gpu_reference("gpu_longest")
    line = "no GPU reference (figures/h200/gpu_longest.json)"
    if ref is not None:
        data, ref_label, _ = ref
        trace = data["cat_trace"]
        right.plot([r["tokens"] / 1000 for r in trace],
                   [(r["reserved"] - r["allocated"]) / MIB for r in trace], "-",
                   color=COLORS["cat"], label="cat: after each chunk")
        fit = [t for t in data["tries"]["prealloc"] if t["fits"]]  # dots: in any order
        pre_gap = [(t["peak_reserved"] - t["peak_allocated"]) / MIB for t in fit]
        right.plot([t["tokens"] / 1000 for t in fit], pre_gap, "o", color=COLORS["prealloc"],
                   label="prealloc: its peak in each trial run that fit (one dot per run)")
        cat_gap = max(r["reserved"] - r["allocated"] for r in trace) / MIB
        short = ref_label.replace(" (emulating a 12 GB card)", "")
        right.set(xlabel="thousands of tokens", ylabel="MiB reserved above allocated",
                  ylim=(0, cat_gap * 1.3))  # room above the data for the legend
        right.set_title(f"REFERENCE: {textwrap.fill(short, 80)}", fontsize=8)
        right.legend(fontsize=7, loc="upper right")
        line = reference_caches(data)  # as notebook 02 prints it
    plots.save(fig, "nb03_flat_memory", {k: {"timeline": r.timeline, "peak": r.peak}
                                         for k, r in sims.items()}, label)
    live, held = pre.timeline["live"], cat.timeline["tokens"][-1]
    longest = {kind: simulated_longest(qwen, card, kind) for kind in sims}  # as 02 and 06 print it
    cat_how = ("reached it too" if cat.fits else f"ran out after {held:,} tokens held (its next "
               f"copy over the {cat.budget / MIB:,.0f} MiB budget)")
    say(f"simulated card, both caches run to {context:,} tokens: prealloc held "
        f"{min(live) / GIB:.3f} GiB from the first chunk to the last (moved "
        f"{(max(live) - min(live)) / MIB:.1f} MiB); cat {cat_how}; longest context on the "
        f"simulated card: {short_of(longest['prealloc'], longest['cat'])}\n{line}")
    return fig


def slots_figure(max_seq: int = 16, chunk: int = 4, prompt: int = 10) -> Figure:
    """Which slots each forward writes and reads: a prompt prefilled in chunks, two decode steps."""
    write, read, idle = "tab:orange", "tab:blue", "0.9"
    steps = [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)]
    steps += [(t, t + 1) for t in (prompt, prompt + 1)]
    label = (f"max_seq = {max_seq}, a {prompt}-token prompt in chunks of {chunk}, "
             "then two decode steps")
    fig, ax = plots.figure(f"Which slots each forward writes and reads\n{label}", size=(10, 3.8))
    for row, (start, end) in enumerate(steps):
        y = len(steps) - 1 - row
        for slot in range(max_seq):
            color = write if start <= slot < end else read if slot < start else idle
            ax.add_patch(Rectangle((slot, y), 0.92, 0.8, facecolor=color, edgecolor="white"))
        what = (f"prefill chunk: writes slots {start} to {end - 1}, reads 0 to {end - 1}"
                if end - start > 1 else
                f"decode step, t = {start}: writes slot {start}, reads 0 to {start} (t + 1 slots)")
        ax.text(-0.3, y + 0.4, what, ha="right", va="center", fontsize=8)
    for slot in range(max_seq):
        ax.text(slot + 0.46, len(steps) + 0.1, str(slot), ha="center", fontsize=7, color="0.3")
    kinds = ((write, "written by this forward (and read)"),
             (read, "read: written by an earlier forward"),
             (idle, "allocated at the start (zeros), not read"))
    ax.legend(handles=[Patch(facecolor=c, label=n) for c, n in kinds], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncols=3, frameon=False)
    ax.set(xlim=(-14, max_seq + 0.2), ylim=(-0.2, len(steps) + 0.9))
    ax.axis("off")
    plots.save(fig, "nb03_slots", {"max_seq": max_seq, "chunk": chunk, "prompt": prompt,
                                   "forwards": [{"writes": [s, e], "reads": [0, e]}
                                                for s, e in steps]}, label)
    return fig


def time_by_context(model, contexts, label: str, steps: int = 8, rounds_n: int = 3) -> Figure:
    """Every cache of the bench timed as the bench times it (:func:`course.bench.ms_per_token`)
    at each context, taking turns in rounds (:mod:`course.rounds`); prealloc against cat said only
    where the spreads part (:func:`course.bench.verdicts`)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, max(contexts)),
                           generator=torch.Generator().manual_seed(0)).to(model.device)
    timed = [rounds({k: partial(bench.ms_per_token, model, prompt[:, :c], k, steps, 512)
                     for k in bench.CACHES}, rounds_n) for c in contexts]
    caches = {k: {"rounds_ms": [t[k] for t in timed],
                  "spread_ms": [(min(t[k]), max(t[k])) for t in timed]} for k in bench.CACHES}
    med = {k: [statistics.median(t[k]) for t in timed] for k in bench.CACHES}
    rows = {"ms / step": [f"{c:,} tokens" for c in contexts]}
    rows |= {k: [shown(t[k]) for t in timed] for k in bench.CACHES}
    rows["cat/prealloc"] = [f"{c / p:.2f}x" for c, p in zip(med["cat"], med["prealloc"])]
    for name, cells in rows.items():
        print((f"{name:<14}" + "".join(f"{cell:<25}" for cell in cells)).rstrip())
    found = disturbed({f"{k} at {c:,}": t[k] for c, t in zip(contexts, timed) for k in t})
    pair = {"contexts": list(contexts), "caches": {k: caches[k] for k in ("prealloc", "cat")}}
    report(f"{label}: ms per decode step, median (min..max) of {rounds_n} rounds of {steps} steps; "
           + "; ".join(bench.verdicts(pair)), found)
    fig = plots.time_per_step({k: (contexts, med[k], tuple(zip(*v["spread_ms"])))
                               for k, v in caches.items()}, flag_label(label, found))
    plots.save(fig, "nb03_time", {"contexts": list(contexts), **caches}, flag_label(label, found))
    return fig


def bench_reference() -> Image:
    """The committed figure of the bench run (``python -m course.bench``), and a line for it and
    for the H200 reference: each cache at the run's longest context, against its bytes' floor."""
    gpu = plots.gpu_reference("bench_time")
    for data, where in [plots.load("bench_time")] + ([gpu[:2]] if gpu else []):
        n, kept = data["contexts"][-1], data["rounds"]
        ms = {k: v["rounds_ms"][-1] for k, v in data["caches"].items()}
        say(f"REFERENCE: {data['model']} on {where}, {kept} rounds, at {n:,} tokens, ms per step: "
            + ", ".join(f"{k} {shown(v)}" + f" in {len(v)} of {kept} rounds" * (len(v) < kept)
                        for k, v in ms.items() if v)
            + "".join(f", {k} out of memory" for k, v in ms.items() if not v)
            + f"; its bytes' floor {data['bandwidth']['floor_ms'][-1]:.1f} ms")
    return Image(filename=plots.FIGURES / "bench_time.png")


def on_this_card(device, qwen_config, dtype, context: int, cap, label: str) -> None:
    """On a GPU under the 12 GiB cap: both caches run on the card, planned again without what the
    libraries hold once the model has loaded and with a 256 MiB margin, so that the run shows the
    memory's shape rather than an out-of-memory."""
    if device.type != "cuda":
        say("No GPU here: the H200 reference above is a real allocator's answer; on a GPU this "
              "cell runs both caches on the card")
        return
    big, _ = kvlib.load_model("random:qwen3-4b", device=device, dtype=dtype)
    held = torch.cuda.memory_allocated(device) - plan_budget(qwen_config, dtype, 12 * GIB).weights
    budget = allocator_budget(device, cap) - max(held, 0) - 256 * MIB
    n = min(context, plan_budget(qwen_config, dtype, budget).max_context)
    parts = []
    for kind in ("prealloc", "cat"):
        rows, oom = card_run(big, n, kind, dtype)
        gap = max((r["reserved"] - r["allocated"] for r in rows), default=0)
        parts.append(f"{kind} reached {rows[-1]['tokens'] if rows else 0:,} "
                     f"({oom or 'no OOM'}), reserved above allocated up to {gap / MIB:,.0f} MiB")
    big = None
    free(device)
    say(f"{label}: {held / MIB:.0f} MiB held beyond the weights after loading; planned {n:,} "
          "tokens; " + "; ".join(parts))
