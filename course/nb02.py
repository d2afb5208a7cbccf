"""Notebook 02's machinery (the ``cat`` cache): the H200 reference figure it opens with, the drawn
decode step, the simulated 12 GiB card, and on a GPU the same run on the card. Each function is one
notebook cell's call and prints at most one line; the notebook keeps the code that teaches.
"""

import inspect

import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from transformers import cache_utils

import kvlib
from course.simulate import simulate
from kvlib.cards import Card, card
from kvlib.cat_cache import CatCache
from kvlib.config import GIB, MIB
from kvlib.kv_cache import KVCache
from kvlib.memory import free, memory_stats

from . import plots, say
from .memory_trace import memory_snapshot
from .quantities import H200, reference_caches, simulated_longest  # noqa: F401 (H200: nb03's)


def source_lines(fn, needle: str) -> list[tuple[int, str]]:
    """(line number, line) of ``fn``'s installed source that contain ``needle``: found by search,
    because line numbers move between releases."""
    src, first = inspect.getsourcelines(fn)
    return [(first + i, line.rstrip()) for i, line in enumerate(src) if needle in line]


def dynamic_layer() -> type:
    """The layer class ``DynamicCache`` grows for full attention: the mapping that names it is
    newer than ``DynamicLayer``, so older releases fall back to that class."""
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    return mapping.get("full_attention", cache_utils.DynamicLayer)


def big_card(device) -> tuple[Card, torch.dtype]:
    """(card, dtype) of the 12 GB run: on a GPU this card under the 12 GiB cap in
    ``kvlib.auto_dtype``'s dtype; elsewhere the course's 12 GiB card in the dtype auto_dtype
    would pick at its compute capability (bf16 from sm 8.0, else fp16)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        here = Card(torch.cuda.get_device_name(device), memory_gb=12, sm=major + minor / 10,
                    bandwidth=0.0, source="this card, capped at 12 GiB")
        return here, kvlib.auto_dtype(device)
    course = card("12 GiB")
    return course, torch.bfloat16 if course.sm >= 8.0 else torch.float16


def _reference():
    ref = plots.gpu_reference("gpu_longest")
    if ref is None:
        print("no GPU reference (figures/h200/gpu_longest.json): no real allocator to show")
    return ref


def fragmentation_figure():
    """The answer first: the H200 reference's ``cat`` cache, grown chunk by chunk under a 12 GiB
    cap, with ``reserved`` far above ``allocated``. Drawn from its JSON, with its label."""
    ref = _reference()
    if ref is None:
        return None
    data, label, _ = ref
    trace = data["cat_trace"]
    x = [r["tokens"] / 1000 for r in trace]
    alloc, resv = [r["allocated"] / GIB for r in trace], [r["reserved"] / GIB for r in trace]
    gap, at = max((r["reserved"] - r["allocated"], r["tokens"]) for r in trace)
    # The title leaves the cap to the label below it, which names it (H200, allocator capped).
    fig, ax = plots.figure("REFERENCE (H200): a cat cache grown chunk by chunk, Qwen3-4B", label,
                           "thousands of tokens in the cache", "GiB", size=(10, 4.6))
    ax.plot(x, alloc, color="tab:red", label="allocated: the tensors alive")
    ax.plot(x, resv, "--", color="tab:red", label="reserved: what the allocator holds")
    ax.fill_between(x, alloc, resv, color="tab:red", alpha=0.15,
                    label="reserved above allocated: freed blocks the allocator keeps")
    ax.annotate(f"{gap / MIB:,.0f} MiB above allocated\nat {at:,} tokens", (at / 1000, (gap + next(
        r["allocated"] for r in trace if r["tokens"] == at)) / GIB), xytext=(0.8, 11.0),
        fontsize=9, arrowprops={"arrowstyle": "->", "color": "0.3"})
    before = next(t for t in data["tries"]["cat"] if t["tokens"] == data["cat"])["allocated_before"]
    ax.annotate(f"{before / GIB:.1f} GiB before the first token:\nweights + runtime",
                (0, before / GIB), xytext=(0.8, 9.6), fontsize=9, va="center",
                arrowprops={"arrowstyle": "->", "color": "0.3"})
    top = data["budget"] / GIB * 1.04
    ax.axhline(data["budget"] / GIB, color="black", lw=1)
    ax.text(0.3, data["budget"] / GIB + 0.05, f"cap {data['budget'] / GIB:g} GiB", fontsize=8)
    for tokens, name, style, side in ((data["cat"], "cat", "-.", "right"),
                                      (data["prealloc"], "preallocated", ":", "left")):
        ax.axvline(tokens / 1000, color="0.3", ls=style, lw=1)
        ax.text(tokens / 1000 + (-0.1 if side == "right" else 0.1), 6.25, name, ha=side,
                va="bottom", fontsize=8)
    lost = data["prealloc"] - data["cat"]
    ax.annotate("", (data["prealloc"] / 1000, 6.9), xytext=(data["cat"] / 1000, 6.9),
                arrowprops={"arrowstyle": "<->", "color": "0.2"})
    ax.text(data["cat"] / 1000 - 0.3, 6.9, f"longest under the cap: cat {data['cat']:,} tokens,\n"
            f"preallocated {data['prealloc']:,} ({lost:,} more, {lost / data['prealloc']:.1%})",
            ha="right", va="center", fontsize=11, fontweight="bold")
    ax.set(ylim=(6.2, top), xlim=(0, data["prealloc"] / 1000 * 1.06))
    ax.legend(fontsize=8, loc="lower left")
    plots.save(fig, "nb02_fragmentation", {"trace": trace, "cat": data["cat"],
                                           "prealloc": data["prealloc"]}, label)
    return fig


def cat_step_figure(t: int = 6) -> Figure:
    """One decode step of a ``cat`` cache, drawn slot by slot: allocate ``t + 1``, copy ``t``,
    write one, free ``t``, which is too short for the next step's ``t + 2`` unless free neighbours
    merge with it."""
    old, new = "tab:blue", "tab:orange"
    label = f"t = {t}: allocate {t + 1} slots, copy {t}, write 1, then free the {t}"
    fig, ax = plots.figure(f"One decode step of a cat cache: one layer's K (V is the same), "
                           f"t = {t} slots held before it", label, size=(9.5, 4.0))

    def slots(x0, y, n, color, text=None, first=0, freed=False):  # n boxes, a freed block dashed
        for i in range(n):
            ax.add_patch(Rectangle((x0 + i, y), 0.9, 0.8, facecolor="none" if freed else color,
                                   edgecolor="0.4" if freed else "white",
                                   ls="--" if freed else "-"))
            ax.text(x0 + i + 0.45, y + 0.4, str(first + i), ha="center", va="center", fontsize=7,
                    color="0.4" if freed else "white")
        if text:
            ax.text(-0.3, y + 0.4, text, ha="right", va="center", fontsize=8)

    slots(0, 5.0, t, old, f"1. before: K [1, Hkv, t={t}, D]")
    slots(0, 3.8, t, old, "2. during: the old K, alive")
    slots(0, 2.5, t, old, f"the new K [1, Hkv, t+1={t + 1}, D]")
    slots(t, 2.5, 1, new, first=t)
    for i in range(t):  # the copy: every old slot read, and written again
        ax.add_artist(FancyArrowPatch((i + 0.45, 3.8), (i + 0.45, 3.3), arrowstyle="-|>",
                                      mutation_scale=8, color="0.3", lw=0.8))
    ax.text(t + 1.4, 3.15, f"allocated: t+1 = {t + 1} slots\ncopied: the t = {t} old slots (read "
            f"{t}, written {t})\nwritten: the new token, into slot t = {t}\nalive at once: "
            f"{2 * t + 1} slots of this layer", fontsize=8, va="center")
    slots(0, 0.9, t, old, "3. after: the old K is freed", freed=True)
    slots(0, -0.4, t, old, f"the cache's K: t+1 = {t + 1} slots")
    slots(t, -0.4, 1, new, first=t)
    ax.text(t + 1.4, 0.9, f"the freed block of {t} slots is too short for\nthe next step, which "
            f"asks for {t + 2}", fontsize=8, va="center")
    ax.set(xlim=(-8, 17.5), ylim=(-0.7, 6.0))
    ax.axis("off")
    plots.save(fig, "nb02_cat_step", {"t": t, "allocated_slots": t + 1, "copied_slots": t,
                                      "alive_at_once": 2 * t + 1}, label)
    return fig


def where_it_dies(qwen, card, naive: int, chunk: int = 512) -> int:
    """A ``cat`` cache on the simulated card (exact tensor bytes, no allocator): its longest context
    (:func:`course.quantities.simulated_longest`, as notebooks 03 and 06 print it), then a run
    pushed past every spare byte in ``chunk``-token chunks; prints where that run died and returns
    the tokens it held."""
    longest = simulated_longest(qwen, card, "cat")
    sim = simulate(qwen, naive + 1024 + 4, cache="cat", card=card, prefill_chunk=chunk, decode=4)
    died = sim.timeline["tokens"][-1] if sim.timeline["tokens"] else 0
    where = str(sim.oom).split(":")[0].removeprefix("simulated OOM at ") if sim.oom else "nowhere"
    say(f"simulated {card.memory / GIB:g} GiB card (exact tensor bytes; no allocator): cat's "
        f"longest context {longest:,} tokens (every prompt up to it fits); a run pushed past it "
        f"died in its {chunk}-token prefill chunk from {died:,} to {died + chunk:,} tokens, at "
        f"{where}; the KV alone (no workspace) would fit {naive:,}")
    return died


def reference_loss() -> None:
    """What growing by ``cat`` cost on a real allocator, like for like: the H200 reference's two
    caches on the same card under the same cap, and the allocator's reserved above allocated."""
    ref = _reference()
    if ref is not None:
        say(reference_caches(ref[0]))


def card_run(big, context: int, cache: str, dtype, chunk: int = 512, decode: int = 4):
    """``simulate()``'s loop on a real card: memory after every chunk and step, and the OOM if one
    comes (caught, reported, freed: the notebook goes on)."""
    device = big.device
    prompt = context - decode
    ids = torch.randint(0, big.config.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    kv = (CatCache.for_model(big.config, device=device, dtype=dtype) if cache == "cat"
          else KVCache.for_model(big.config, context, device=device, dtype=dtype))
    rows, oom, logits = [], None, None
    try:
        for s in range(0, prompt, chunk):
            torch.cuda.reset_peak_memory_stats(device)
            logits = kvlib.forward(big, ids[:, s : s + chunk], kv, s)
            rows.append({"tokens": kv.seq_len, **memory_stats(device)})
        for pos in range(prompt, context):
            torch.cuda.reset_peak_memory_stats(device)
            logits = kvlib.forward(big, logits.argmax(-1, keepdim=True), kv, pos)
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
    ids = torch.randint(0, big.config.vocab_size, (1, 256),
                        generator=torch.Generator().manual_seed(1))
    with memory_snapshot(path, device=device):
        kvlib.generate(big, ids.to(device), 300, cache="cat", eos_token_id=None)
    rows, oom = card_run(big, context, "cat", dtype)
    big = None
    free(device)
    worst = max(rows, key=lambda r: r["reserved"] - r["allocated"], default=None)
    say(f"{label}: cat reached {rows[-1]['tokens'] if rows else 0:,} "
          f"tokens ({oom or 'no OOM'}); reserved above allocated up to "
          f"{(worst['reserved'] - worst['allocated']) / MIB if worst else 0:,.0f} MiB; allocator "
          f"history in {path} (drag it into https://pytorch.org/memory_viz)")
