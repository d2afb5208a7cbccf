"""Notebook 02's machinery (the ``cat`` cache), one cell a function: the H200 reference figure, the
drawn decode step, the simulated 12 GiB card, and on a GPU the same run on the card."""

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

import kvlib
from kvlib.cards import Card, card
from kvlib.config import GIB, MIB
from kvlib.memory import free, memory_snapshot, memory_stats

from . import plots, say
from .quantities import H200, reference_caches, short_of, simulated_longest  # noqa: F401 (H200: nb03's)
from .simulate import MAKE, simulate


def big_card(device) -> tuple[Card, torch.dtype]:
    """(card, dtype) of the 12 GB run: on a GPU this card under the 12 GiB cap; elsewhere the
    course's 12 GiB card, in the dtype auto_dtype picks at its sm (bf16 from sm 8.0, else fp16)."""
    if device.type != "cuda":
        course = card("12 GiB")
        return course, torch.bfloat16 if course.sm >= 8.0 else torch.float16
    major, minor = torch.cuda.get_device_capability(device)
    return Card(torch.cuda.get_device_name(device), memory_gb=12, sm=major + minor / 10,
                bandwidth=0.0, source="this card, capped at 12 GiB"), kvlib.auto_dtype(device)


def fragmentation_figure():
    """The answer first: the H200 reference's ``cat`` cache, reserved far above allocated."""
    data, label = plots.load("gpu_longest", plots.FIGURES / "h200")  # the GPU check's runs
    trace, cat, pre, cap = data["cat_trace"], data["cat"], data["prealloc"], data["budget"] / GIB
    x = [r["tokens"] / 1000 for r in trace]
    alloc, resv = [r["allocated"] / GIB for r in trace], [r["reserved"] / GIB for r in trace]
    gap, at, top = max((r["reserved"] - r["allocated"], r["tokens"], r["reserved"]) for r in trace)
    before = next(t for t in data["tries"]["cat"] if t["tokens"] == cat)["allocated_before"]
    # The title leaves the cap to the label below it, which names it (H200, allocator capped).
    fig, ax = plots.figure("REFERENCE (H200): a cat cache grown chunk by chunk, Qwen3-4B", label,
                           "thousands of tokens in the cache", "GiB", size=(10, 4.6))
    ax.plot(x, alloc, color="tab:red", label="allocated: the tensors alive")
    ax.plot(x, resv, "--", color="tab:red", label="reserved: what the allocator holds")
    ax.fill_between(x, alloc, resv, color="tab:red", alpha=0.15,
                    label="reserved above allocated: freed blocks the allocator keeps")
    ax.axhline(cap, color="black", lw=1, label=f"the cap, {cap:g} GiB")
    ax.axhline(before / GIB, color="0.5", lw=1, ls=":",
               label=f"{before / GIB:.1f} GiB before the first token: weights + runtime")
    ax.axvline(cat / 1000, color="0.3", ls="-.", lw=1,
               label=f"longest under the cap: {short_of(pre, cat)}")
    ax.axvline(pre / 1000, color="0.3", ls=":", lw=1, label=f"longest, prealloc: {pre:,} tokens")
    ax.annotate(f"{gap / MIB:,.0f} MiB above allocated\nat {at:,} tokens", (at / 1000, top / GIB),
                xytext=(0.8, 11.0), fontsize=9, arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.set(ylim=(6.2, cap * 1.04), xlim=(0, pre / 1000 * 1.06))
    ax.legend(fontsize=8, loc="lower right")
    plots.save(fig, "nb02_fragmentation", {"trace": trace, "cat": cat, "prealloc": pre}, label)
    return fig


def cat_step_figure(t: int = 6) -> Figure:
    """One decode step of a ``cat`` cache, drawn slot by slot; its label says the step in words
    (the freed block is too short for the next step unless free neighbours merge with it)."""
    label = (f"t = {t}: allocate {t + 1} slots, copy {t}, write 1 ({2 * t + 1} slots alive at "
             f"once), then free the {t}, too short for the next step's {t + 2}")
    fig, ax = plots.figure(f"One decode step of a cat cache: one layer's K (V is the same), "
                           f"t = {t} slots held before it", label, size=(9.5, 4.0))
    rows = ((5.0, f"1. before: K [1, Hkv, t={t}, D]", t, False),
            (3.8, "2. during: the old K, alive", t, False),
            (2.5, f"the new K [1, Hkv, t+1={t + 1}, D]", t + 1, False),
            (0.9, "3. after: the old K is freed", t, True),
            (-0.4, f"the cache's K: t+1 = {t + 1} slots", t + 1, False))
    for y, text, n, freed in rows:  # n boxes, slot t (the new token) orange, a freed block dashed
        ax.text(-0.3, y + 0.4, text, ha="right", va="center", fontsize=8)
        boxes = ax.barh(y, 0.9, 0.8, range(n), align="edge", ls="--" if freed else "-",
                        edgecolor="0.4" if freed else "white",
                        color=["none" if freed else "tab:orange" if i == t else "tab:blue"
                               for i in range(n)])
        ax.bar_label(boxes, range(n), label_type="center", fontsize=7,
                     color="0.4" if freed else "white")
    for i in range(t):  # the copy: every old slot read, and written again
        ax.add_artist(FancyArrowPatch((i + 0.45, 3.8), (i + 0.45, 3.3), arrowstyle="-|>",
                                      mutation_scale=8, color="0.3", lw=0.8))
    ax.set(xlim=(-8, 12), ylim=(-0.7, 6.0))
    ax.axis("off")
    plots.save(fig, "nb02_cat_step", {"t": t, "allocated_slots": t + 1, "copied_slots": t,
                                      "alive_at_once": 2 * t + 1}, label)
    return fig


def where_it_dies(qwen, card, naive: int, chunk: int = 512) -> None:
    """A ``cat`` cache on the simulated card: its longest context (as notebooks 03 and 06 print it),
    where a run pushed past every spare byte in ``chunk``-token chunks died; then, like for like,
    what ``cat`` cost on a real allocator: the H200 reference's two caches on one card, one cap."""
    longest = simulated_longest(qwen, card, "cat")
    sim = simulate(qwen, naive + 1024 + 4, cache="cat", card=card, prefill_chunk=chunk, decode=4)
    died = sim.timeline["tokens"][-1] if sim.timeline["tokens"] else 0
    where = str(sim.oom).split(":")[0].removeprefix("simulated OOM at ") if sim.oom else "nowhere"
    say(f"simulated {card.memory / GIB:g} GiB card (exact tensor bytes; no allocator): cat's "
        f"longest context {longest:,} tokens (every prompt up to it fits); a run pushed past it "
        f"died in its {chunk}-token prefill chunk from {died:,} to {died + chunk:,} tokens, at "
        f"{where}; the KV alone (no workspace) would fit {naive:,}")
    say(reference_caches(plots.load("gpu_longest", plots.FIGURES / "h200")[0]))


def card_run(big, context: int, cache: str, dtype, chunk: int = 512, decode: int = 4):
    """``simulate()``'s loop on a real card: memory after every chunk and step, and the OOM if one
    comes (caught, reported, freed: the notebook goes on)."""
    device, prompt = big.device, context - decode
    ids = torch.randint(0, big.config.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    kv = MAKE[cache](big.config, context, device=device, dtype=dtype)
    rows, oom, logits = [], None, None
    try:  # the prefill's chunks, then the decode steps
        for pos in [*range(0, prompt, chunk), *range(prompt, context)]:
            torch.cuda.reset_peak_memory_stats(device)
            piece = ids[:, pos : pos + chunk] if pos < prompt else logits.argmax(-1, keepdim=True)
            logits = kvlib.forward(big, piece, kv, pos)
            rows.append({"tokens": kv.seq_len, **memory_stats(device)})
    except torch.OutOfMemoryError as e:
        oom = f"{str(e).splitlines()[0]} (after {rows[-1]['tokens'] if rows else 0:,} tokens)"
    kv = logits = None
    free(device)
    return rows, oom


def on_this_card(device, dtype, context: int, label: str) -> None:
    """On a GPU under the 12 GiB cap: the ``cat`` cache run past the card's end, and an allocator
    history of its first steps for https://pytorch.org/memory_viz. Off a GPU: one line saying so."""
    if device.type != "cuda":
        print("(GPU only)")
        return
    free(device)  # what the lesson model left cached
    big, _ = kvlib.load_model("random:qwen3-4b", device=device, dtype=dtype)
    path = plots.FIGURES / "runs" / "nb02_cat_snapshot.pickle"  # git ignores figures/runs/
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.zeros(1, 256, dtype=torch.long, device=device)  # any ids: the same allocations
    with memory_snapshot(path, device=device):
        kvlib.generate(big, ids, 300, cache="cat", eos_token_id=None)
    rows, oom = card_run(big, context, "cat", dtype)
    big = None
    free(device)
    gap = max((r["reserved"] - r["allocated"] for r in rows), default=0)
    say(f"{label}: cat reached {rows[-1]['tokens'] if rows else 0:,} tokens ({oom or 'no OOM'}); "
        f"reserved above allocated up to {gap / MIB:,.0f} MiB; allocator history in {path} (drag "
        "it into https://pytorch.org/memory_viz)")
