"""Notebook 07's machinery: the request trace and the real caches priced on it, the paged-attention
kernels probed, timing in rounds, and the figures; the notebook keeps the caches it builds, what it
times and the arithmetic it teaches."""

import statistics
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from kvlib.meter import fill
from kvlib.paged_cache import OutOfBlocks

from . import plots, say
from .rounds import disturbed, flag_label, report, rounds, timed

TRACE = Path(__file__).resolve().parents[1] / "notebooks/data/azure_llm_conv_2023_sample.csv"


def trace() -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, output tokens) per request, in trace order (the file's header says how)."""
    rows = [line for line in TRACE.read_text().splitlines() if not line.startswith("#")][1:]
    return np.loadtxt(rows, delimiter=",", dtype=np.int64, unpack=True)


def priced(make, slots, keep: bool = False) -> list[tuple[int, int]]:
    """(reserved, written) bytes of each request's cache, in order, made by ``make`` and written to
    its ``slots`` (layer 0's write takes a pool's blocks) until a pool runs out of blocks; each
    given back before the next is made, unless ``keep`` (requests decoding together)."""
    out = []
    for n in slots.tolist():
        cache = make()
        try:
            fill(cache, n, layers=1)
        except OutOfBlocks:
            break
        out.append((cache.nbytes, n * cache.bytes_per_token))
        if not keep:
            cache.reset()
    return out


def waste_figure(reserved_used: dict, requests: int, label: str) -> Figure:
    """The share of each policy's reserved KV memory that is never written, one bar a policy: the
    two preallocated caches first (the notebook's ``policies``), red and orange, the pages green."""
    waste = [100 * (1 - used / reserved) for reserved, used in reserved_used.values()]
    fig, ax = plots.figure("KV memory reserved but never written", f"{requests:,} requests of the "
                           f"Azure LLM trace 2023 (conversation); Qwen3-4B bf16 · {label}",
                           "waste: 1 - used / reserved (%)", size=(10, 3.8))
    colors = ["tab:red", "tab:orange"] + ["tab:green"] * (len(waste) - 2)
    ax.bar_label(ax.barh(list(reserved_used), waste, color=colors), fmt="{:.1f}%", fontsize=8,
                 padding=3)
    ax.set(xlim=(0, 100))
    ax.invert_yaxis()
    return fig


def ms_rounds(calls: dict, device, n: int) -> tuple[dict, list]:
    """({key: [ms of each round]}, flagged): the calls take turns in ``n`` rounds
    (:mod:`course.rounds`), a round's time the median of 5 calls after one warm-up."""
    timings = rounds({key: timed(fn, device, repeats=5, warmup=1) for key, fn in calls.items()}, n)
    ms = {key: [1e3 * s for s in v] for key, v in timings.items()}
    return ms, disturbed({f"{key} (ms)": v for key, v in ms.items()})


def in_place_kernels(device, pages: int = 256, block: int = 16, context: int = 1000) -> None:
    """Attention of one query over a ``context``-token request whose blocks lie scattered in a pool
    of ``pages``, two ways: kvlib's gather + SDPA, and eager FlexAttention reading the pool in place
    through a mask of the request's slots (compiled: minutes on a CPU). One line each: the ms of
    each (medians of rounds), and whether the results agree: printed."""
    hq, hkv, d = 9, 3, 64  # SmolLM2's heads
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(1, h, n, d, generator=g).to(device)  # K and V: one layer of a pool
               for h, n in ((hkv, pages * block), (hkv, pages * block), (hq, 1)))
    table = torch.randperm(pages, generator=g)[: -(-context // block)].to(device)  # its blocks
    slots = (table[:, None] * block + torch.arange(block, device=device)).flatten()[:context]
    mine = torch.zeros(pages * block, dtype=torch.bool, device=device).index_fill_(0, slots, True)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: mine[kv_idx], B=1, H=None, Q_LEN=1,
                             KV_LEN=pages * block, BLOCK_SIZE=block, device=device)

    def gather_sdpa():  # what PagedCache.view and the decoder do: whole blocks, in table order
        ks, vs = (t.view(hkv, pages, block, d).index_select(1, table).view(1, hkv, -1, d)
                  [:, :, :context] for t in (k, v))
        return F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), ks, vs).view(q.shape)

    flex = partial(flex_attention, q, k, v, block_mask=mask, enable_gqa=True)
    with warnings.catch_warnings(action="ignore"):  # eager flex: "builds the whole score matrix"
        same = torch.allclose(flex(), gather_sdpa(), atol=1e-5)
        ms, flagged = ms_rounds({"gather": gather_sdpa, "flex": flex}, device, 3)
    gathered, took = (statistics.median(ms[way]) for way in ("gather", "flex"))
    copied = 2 * hkv * len(table) * block * d * 4  # K and V of its whole blocks, fp32
    say(f"gather + SDPA: {gathered:.2f} ms, copies {copied:,} B per call")
    report(f"FlexAttention, eager, in place: same result {same}, {took:.2f} ms "
           f"({took / gathered:.1f}x the gather; medians of 3 rounds)", flagged)


def throughput_figure(per_round: dict, floor: dict, cards: dict, fits: dict, label: str,
                      context: int) -> Figure:
    """Left: tokens/s by batch on this machine (median, range of the rounds) beside the bandwidth
    limit. Right: the bandwidth limit of named cards for Qwen3-4B, with what 12 GiB admits."""
    batches, runs = list(per_round), list(per_round.values())
    fig, (left, right) = plots.figure("Tokens/s against batch size", f"left: SmolLM2-135M · "
                                      f"{label}", xlabel="batch", size=(12, 4), panels=2)
    (line,) = left.plot(batches, [statistics.median(v) for v in runs], "o-",
                        label="measured (median of rounds)")
    left.fill_between(batches, [min(v) for v in runs], [max(v) for v in runs], alpha=0.2, lw=0,
                      color=line.get_color(), label="measured: range of the rounds")
    left.plot(batches, [floor[b] for b in batches], "--", color="0.4",
              label="bandwidth limit (tokens/s): bytes / copy bandwidth")
    left.set(title="SmolLM2-135M on this machine", ylabel="tokens/s (log scale)", xticks=batches,
             yscale="log")  # the CPU's batch 1 and its limit differ several-fold
    for (card, curve), color in zip(cards.items(), ("tab:blue", "tab:purple")):  # not the fits'
        right.plot(*zip(*curve.items()), color=color, label=f"{card}: bandwidth limit (tokens/s)")
        right.plot(list(fits.values()), [curve[b] for b in fits.values()], "o", color=color)
    for (name, b), c in zip(fits.items(), ("tab:red", "tab:orange", "tab:green")):
        right.axvline(b, color=c, ls=":", label=f"fits 12 GiB at {context:,} tokens: {name} ({b})")
    right.set(title="Qwen3-4B bf16: bandwidth limit, an upper bound, not a forecast",
              ylabel="tokens/s", xlim=(0, max(fits.values()) + 1))
    for ax in (left, right):
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    return fig


def gathers(paged, n: int) -> None:
    """Each layer's view of ``n + 1`` slots as attention reads them: what pages add to a step."""
    for layer in range(paged.n_layers):
        paged.view(layer, n + 1)


def paging_figure(round_ms: dict, predicted: dict, label: str, flagged: list) -> Figure:
    """What reading pages adds per step and the gathers alone, medians with the range of the
    rounds, beside the prediction (``{context: ms}``); a disturbed run said in the label."""
    contexts = list(predicted)
    series = {"PREDICTION: 2 x gather bytes / copy bandwidth": (contexts, list(predicted.values()))}
    for kind, name in (("paging adds", "paged step minus prealloc step, round by round"),
                       ("gathers alone", "gathers alone (view(): a new tensor per layer)")):
        runs = [round_ms[f"{kind} at {n}"] for n in contexts]
        series[name] = (contexts, [statistics.median(v) for v in runs],
                        ([min(v) for v in runs], [max(v) for v in runs]))
    what = "what reading pages adds: SmolLM2-135M, pages of 16; medians, bands: range of the rounds"
    fig = plots.time_per_step(series, flag_label(f"{what} · {label}", flagged))
    drawn = [y for _, ys, *_ in series.values() for y in ys]  # the medians and the prediction
    fig.axes[0].set_ylim(min(0, 1.5 * min(drawn)), 1.5 * max(drawn))  # outlying rounds run off it
    return fig
