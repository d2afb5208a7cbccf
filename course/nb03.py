"""Notebook 03's machinery (the preallocated cache): the figure it opens with (the simulated 12 GiB
card beside the H200 reference), the drawn slots, the interleaved timing of the two caches, and on
a GPU both caches run on the card. Each function is one notebook cell's call and prints one line
(two where it sets this run beside the H200 reference).
"""

import statistics
import textwrap
from functools import partial

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

import kvlib
from course.simulate import simulate
from kvlib.bandwidth import step_bytes
from kvlib.budget import plan_budget
from kvlib.config import GIB, MIB
from kvlib.memory import allocator_budget, free

from . import plots, say
from .nb02 import H200, big_card, card_run  # noqa: F401 (big_card: the notebook's lab.big_card)
from .quantities import reference_caches, short_of, simulated_longest
from .rounds import disturbed, report, rounds

COLORS = plots.CACHE_COLORS


def answer_figure(qwen, card, context: int):
    """Both caches run to ``context`` tokens on the simulated card (every chunk and step: exact
    tensor bytes), beside the H200 reference's reserved-above-allocated for each."""
    sims = {kind: simulate(qwen, context, cache=kind, card=card) for kind in ("prealloc", "cat")}
    label = (f"simulated {card.memory / GIB:g} GiB card (meta device: exact tensor bytes; "
             f"no allocator) · Qwen3-4B {str(qwen.dtype).removeprefix('torch.')}")
    fig, (left, right) = plots.figure("The preallocated cache against the cat cache on a 12 GiB "
                                      "card", size=(12, 4.6), panels=2)
    cat = sims["cat"]
    for kind, run in sims.items():
        x = [t / 1000 for t in run.timeline["tokens"]]
        left.plot(x, [b / GIB for b in run.timeline["live"]], color=COLORS[kind],
                  label=f"{kind}: held between steps")
        left.plot(x, [b / GIB for b in run.timeline["peak"]], ":", color=COLORS[kind],
                  label=f"{kind}: peak during the chunk")
    if not cat.fits:  # where the cat cache's next copy asked for more than the budget
        left.plot(cat.timeline["tokens"][-1] / 1000, cat.timeline["peak"][-1] / GIB, "x",
                  color=COLORS["cat"], ms=12, mew=2.5, label="cat: out of memory")
    left.axhline(card.memory / GIB, color="black", lw=1.5, ls="--",
                 label=f"budget {card.memory / GIB:g} GiB")
    held = min(sims["prealloc"].timeline["live"]) / GIB
    left.text(0.5, card.memory / GIB + 0.06, f"budget {card.memory / GIB:g} GiB", fontsize=8)
    left.text(0.5, held - 0.2, f"prealloc: flat at {held:.3f} GiB", fontsize=8,
              color=COLORS["prealloc"])
    left.set(title=textwrap.fill(label, 80), xlabel="thousands of tokens held", ylabel="GiB",
             ylim=(7, card.memory / GIB * 1.025))
    left.legend(fontsize=7, loc="lower right")
    zoom = left.inset_axes([0.06, 0.5, 0.38, 0.25])  # the last tokens, where the lines nearly touch
    end = sims["prealloc"].timeline["tokens"][-1]
    for kind, run in sims.items():
        near = [i for i, t in enumerate(run.timeline["tokens"]) if t >= end - 2048]
        for key, style in (("live", "-"), ("peak", ":")):
            zoom.plot([run.timeline["tokens"][i] / 1000 for i in near],
                      [run.timeline[key][i] / GIB for i in near], style, color=COLORS[kind])
    zoom.axhline(card.memory / GIB, color="black", lw=1.5, ls="--")
    if not cat.fits:
        zoom.plot(cat.timeline["tokens"][-1] / 1000, cat.timeline["peak"][-1] / GIB, "x",
                  color=COLORS["cat"], ms=8, mew=2)
    zoom.set_ylim(card.memory / GIB - 0.06, card.memory / GIB + 0.005)
    zoom.set_title(f"zoom: prealloc peaks at {sims['prealloc'].peak / MIB:,.1f} of "
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
        fit = sorted((t for t in data["tries"]["prealloc"] if t["fits"]), key=lambda t: t["tokens"])
        pre_gap = [(t["peak_reserved"] - t["peak_allocated"]) / MIB for t in fit]
        right.plot([t["tokens"] / 1000 for t in fit], pre_gap, "o", color=COLORS["prealloc"],
                   label="prealloc: its peak in each trial run that fit (one dot per run)")
        cat_gap = max(r["reserved"] - r["allocated"] for r in trace) / MIB
        short = ref_label.replace(" (emulating a 12 GB card)", "")
        right.set(title=f"REFERENCE: {textwrap.fill(short, 80)}",
                  xlabel="thousands of tokens", ylabel="MiB reserved above allocated",
                  ylim=(0, cat_gap * 1.3))  # room above the data for the legend
        right.legend(fontsize=7, loc="upper right")
        line = reference_caches(data)  # as notebook 02 prints it
    for ax in (left, right):
        ax.title.set_fontsize(8)
    plots.save(fig, "nb03_flat_memory", {k: {"timeline": r.timeline, "peak": r.peak}
                                         for k, r in sims.items()}, label)
    live, held = sims["prealloc"].timeline["live"], cat.timeline["tokens"][-1]
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
    for color, name in ((write, "written by this forward (and read)"),
                        (read, "read: written by an earlier forward"),
                        (idle, "allocated at the start (zeros), not read")):
        ax.add_patch(Rectangle((0, -10), 1, 1, facecolor=color, label=name))  # legend entries only
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncols=3, frameon=False)
    ax.set(xlim=(-14, max_seq + 0.2), ylim=(-0.2, len(steps) + 0.9))
    ax.axis("off")
    plots.save(fig, "nb03_slots", {"max_seq": max_seq, "chunk": chunk, "prompt": prompt,
                                   "forwards": [{"writes": [s, e], "reads": [0, e]}
                                                for s, e in steps]}, label)
    return fig


def time_both(model, context: int, label: str, ref_config, steps: int = 8, rounds_n: int = 3):
    """Decode steps after a ``context``-token prompt, both caches, in rounds
    (:mod:`course.rounds`); two lines: the ratio, its range over the rounds and the bytes ratio
    here; the H200 reference's ratio, its bytes ratio (from ``ref_config``, the reference model's
    config) and how far its step sat above its bandwidth floor."""
    ids = torch.randint(0, model.config.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    ms = rounds({kind: partial(generate_timed, model, ids, kind, steps)
                 for kind in ("prealloc", "cat")}, rounds_n)
    per_round = sorted(c / p for c, p in zip(ms["cat"], ms["prealloc"]))
    ratio = statistics.median(ms["cat"]) / statistics.median(ms["prealloc"])
    ceiling = (step_bytes(model.config, model.dtype, context, "cat")
               / step_bytes(model.config, model.dtype, context, "prealloc"))
    ref = plots.gpu_reference("bench_time")
    h200 = ""
    if ref is not None:
        data = ref[0]
        cat, pre = (data["caches"][k]["ms_per_token"][-1] for k in ("cat", "prealloc"))
        name = data["model"].replace("random:", "random-weight ").replace("qwen3-4b", "Qwen3-4B")
        n, dtype = data["contexts"][-1], getattr(torch, data["dtype"])
        ref_bytes = step_bytes(ref_config, dtype, n, "cat") / step_bytes(ref_config, dtype, n)
        floor = data["bandwidth"]["floor_ms"][-1]
        h200 = (f"REFERENCE ({H200}; {name}, {data['dtype']}, {n:,} tokens): cat / prealloc "
                f"{cat / pre:.2f}x; bytes ratio {ref_bytes:.2f}x; its prealloc step took "
                f"{pre:.1f} ms, {pre / floor:.0f}x the {floor:.1f} ms its bytes need at its "
                "measured bandwidth")
    report(f"{label}: after {context:,} tokens, cat / prealloc {ratio:.2f}x (per round "
           f"{per_round[0]:.2f}..{per_round[-1]:.2f}; prealloc "
           f"{statistics.median(ms['prealloc']):.1f} ms/step); bytes ratio {ceiling:.2f}x",
           disturbed({f"{k} ms/step": v for k, v in ms.items()}))
    if h200:
        say(h200)


def generate_timed(model, ids, kind: str, steps: int) -> float:
    """Median ms of ``steps`` decode steps after ``ids``, prefilled in 512-token chunks."""
    out = kvlib.generate(model, ids, steps + 1, cache=kind, eos_token_id=None, timed=True,
                         prefill_chunk=512)
    return 1e3 * statistics.median(out.step_s)


def on_this_card(device, qwen_config, dtype, context: int, cap, label: str) -> None:
    """On a GPU under the 12 GiB cap: both caches run on the card, planned again without what the
    libraries hold once the model has loaded and with a 256 MiB margin, so that the run shows the
    memory's shape rather than an out-of-memory. Off a GPU: one line saying so."""
    if device.type != "cuda":
        say("No GPU here: the H200 reference above is a real allocator's answer; on a GPU this "
              "cell runs both caches on the card")
        return
    big, _ = kvlib.load_model("random:qwen3-4b", device=device, dtype=dtype)
    weights = plan_budget(qwen_config, dtype, 12 * GIB).weights
    held = torch.cuda.memory_allocated(device) - weights
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
