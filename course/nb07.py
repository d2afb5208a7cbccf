"""Notebook 07's machinery: the request trace and its waste figure, admission into 12 GiB, the
paged-attention kernels probed, and the two timings (tokens/s by batch; what pages add to a step)
with their figures. The notebook keeps the caches it builds and the arithmetic it teaches.
"""

import statistics
import textwrap
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

import kvlib
from kvlib.config import kv_heads
from kvlib.kv_cache import KVCache
from kvlib.meter import fill
from kvlib.paged_cache import BlockPool, OutOfBlocks, PagedCache

from . import plots, wrapped
from .rounds import disturbed, flag_label, flag_line, rounds, timed

TRACE = (Path(__file__).resolve().parents[1] / "notebooks" / "data"
         / "azure_llm_conv_2023_sample.csv")
BATCH_STEPS = 6  # decode steps timed per batch and round


def trace() -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, output tokens) per request, in trace order (the file's header says how)."""
    rows = [line for line in TRACE.read_text().splitlines() if not line.startswith("#")][1:]
    return np.loadtxt(rows, delimiter=",", dtype=np.int64, unpack=True)


def policies(config, dtype, max_seq: int, prompt_len, out_cap: int, blocks, pool_tokens=None):
    """{name: a function making one request's cache}, on ``meta``: a slab of ``max_seq``, a slab of
    prompt + ``out_cap`` (the prompts taken in trace order), and pages of each block size in one
    pool: of ``pool_tokens[block] // block`` blocks, or by default enough for any one request."""
    lengths = iter(prompt_len.tolist())

    def slab(n):
        return KVCache.for_model(config, n, device="meta", dtype=dtype)

    made = {f"slab of {max_seq:,}": lambda: slab(max_seq),
            f"slab of prompt + {out_cap:,}": lambda: slab(next(lengths) + out_cap)}
    for block in blocks:
        n = pool_tokens[block] // block if pool_tokens else -(-max_seq // block)
        pool = BlockPool.for_model(config, n_blocks=n, block=block, device="meta", dtype=dtype)
        made[f"pages of {block}"] = lambda p=pool: PagedCache(p)
    return made


def waste(made: dict, slots, dtype) -> dict:
    """{policy: (reserved, used) bytes} over every request, each written to its full length."""
    out = {}
    for name, make in made.items():
        reserved = used = 0
        for n in slots.tolist():
            cache = make()
            fill(cache, n, layers=1)  # the first layer's write takes a pool's blocks
            reserved, used = reserved + cache.nbytes, used + n * cache.bytes_per_token
            cache.reset()
        out[name] = (reserved, used)
    return out


def admitted(made: dict, slots, dtype, kv_bytes: int) -> dict:
    """{policy: requests admitted}, in trace order, each at its full length, until the next one
    does not fit: a pool runs out of blocks (``OutOfBlocks``); slabs pass ``kv_bytes`` together."""
    out = {}
    for name, make in made.items():
        held = count = 0
        for n in slots.tolist():
            cache = make()
            try:
                fill(cache, n, layers=1)
            except OutOfBlocks:
                break
            held += cache.nbytes if isinstance(cache, KVCache) else 0
            if held > kv_bytes:
                break
            count += 1
        out[name] = count
    return out


def waste_figure(reserved_used: dict, requests: int, label: str) -> Figure:
    """The share of each policy's reserved KV memory that is never written, one bar a policy."""
    share = {name: 1 - used / reserved for name, (reserved, used) in reserved_used.items()}
    fig, ax = plots.figure("KV memory reserved but never written", f"{requests:,} requests of the "
                           f"Azure LLM trace 2023 (conversation); Qwen3-4B bf16 · {label}",
                           "waste: 1 - used / reserved (%)", size=(8, 3.8))
    colors = ["tab:red" if n.startswith("slab of ") and "prompt" not in n else
              "tab:orange" if n.startswith("slab") else "tab:green" for n in share]
    ax.barh(list(share), [100 * w for w in share.values()], color=colors)
    for y, w in enumerate(share.values()):
        ax.text(100 * w + 1, y, f"{w:.1%}", va="center", fontsize=8)
    ax.set(xlim=(0, 100))
    ax.invert_yaxis()
    return fig


def in_place_kernels(device, pages: int = 256, block: int = 16, context: int = 1000) -> list[str]:
    """Attention of one query over a ``context``-token request in a pool of ``pages`` blocks, three
    ways: kvlib's gather + SDPA, eager FlexAttention in place (compiled: minutes on a CPU), and
    ``varlen_attn`` with a block table. One line each: same result, ms (in rounds), or why not."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.attention.varlen import varlen_attn

    hq, hkv, d = 9, 3, 64  # SmolLM2's heads
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, hkv, pages * block, d, generator=g).to(device)  # one layer of a pool
    v = torch.randn(1, hkv, pages * block, d, generator=g).to(device)
    q = torch.randn(1, hq, 1, d, generator=g).to(device)
    paged = PagedAttention(pages, block, max_batch_size=1, device=device)
    paged.reserve(torch.tensor([0], device=device), torch.tensor([context], device=device))
    table = paged.page_table[0, : -(-context // block)]
    kv_len = torch.tensor([context], device=device)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, B=1, H=None, Q_LEN=1,
                                KV_LEN=len(table) * block, BLOCK_SIZE=block, device=device)
    mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)

    def gather_sdpa():  # what PagedCache.view and the decoder do
        ks = k.view(hkv, pages, block, d).index_select(1, table).view(1, hkv, -1, d)[:, :, :context]
        vs = v.view(hkv, pages, block, d).index_select(1, table).view(1, hkv, -1, d)[:, :, :context]
        out = F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), ks, vs)
        return out.view(1, hq, 1, d)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it builds the whole score matrix
        flex = partial(flex_attention, q, k, v, block_mask=mask, enable_gqa=True)
        same = torch.allclose(flex(), gather_sdpa(), atol=1e-5)
        ms = rounds({way: timed(fn, device, repeats=5, warmup=1)
                     for way, fn in (("gather", gather_sdpa), ("flex", flex))}, 3)
    gathered, took = (1e3 * statistics.median(ms[way]) for way in ("gather", "flex"))
    lines = [f"gather + SDPA: {gathered:.2f} ms, copies "
             f"{2 * hkv * len(table) * block * d * 4:,} B per call",
             flag_line(f"FlexAttention, eager, in place: same result {same}, {took:.2f} ms "
                       f"({took / gathered:.1f}x the gather; medians of 3 rounds)",
                       disturbed({f"{w} (ms)": [x * 1e3 for x in v] for w, v in ms.items()}))]
    if torch.device(device).type != "cuda":
        lines.append("varlen_attn with a block_table: needs CUDA (FlashAttention); skipped here")
        return [wrapped(line) for line in lines]
    try:
        pool_k = k[0].view(hkv, pages, block, d).permute(1, 2, 0, 3)  # [pages, block, H, D]
        varlen_attn(q[0].transpose(0, 1), pool_k, pool_k,
                    torch.tensor([0, 1], dtype=torch.int32, device=device), None, 1, context,
                    enable_gqa=True, seqused_k=kv_len.int(), block_table=table.int().view(1, -1))
        lines.append("varlen_attn with a block_table: ran")
    except Exception as err:
        lines.append(f"varlen_attn with a block_table: {type(err).__name__}: {str(err)[:120]}")
    return [wrapped(line) for line in lines]


def batch_throughput(model, prompt, batches=(1, 2, 4, 8, 16), steps: int = BATCH_STEPS,
                     rounds_n: int = 3):
    """({batch: [tokens/s of each round]}, flagged): B copies of ``prompt`` decoded ``steps`` steps,
    the batch sizes taking turns in rounds (:mod:`course.rounds`); a round's tokens/s is B over
    its median step."""
    def tokens_per_s(b):
        gens = kvlib.generate(model, [prompt] * b, steps + 1, eos_token_id=None, timed=True)
        return b / statistics.median(gens[0].step_s)

    per_round = rounds({b: partial(tokens_per_s, b) for b in batches}, rounds_n)
    return per_round, disturbed({f"batch {b}": v for b, v in per_round.items()})


def throughput_figure(per_round: dict, floor: dict, cards: dict, fits: dict, label: str,
                      context: int) -> Figure:
    """Left: tokens/s by batch on this machine (median, range of the rounds) beside the bandwidth
    limit. Right: the bandwidth limit of named cards for Qwen3-4B, with what 12 GiB admits."""
    batches = list(per_round)
    fig, (left, right) = plots.figure("Tokens/s against batch size", xlabel="batch", size=(12, 4),
                                      panels=2)
    (line,) = left.plot(batches, [statistics.median(v) for v in per_round.values()], "o-",
                        label="measured (median of rounds)")
    left.fill_between(batches, [min(v) for v in per_round.values()],
                      [max(v) for v in per_round.values()], color=line.get_color(), alpha=0.2, lw=0,
                      label="measured: range of the rounds")
    left.plot(batches, [floor[b] for b in batches], "--", color="0.4",
              label="bandwidth limit (tokens/s): bytes / copy bandwidth")
    left.set(title=textwrap.fill(f"SmolLM2-135M · {label}", 110), ylabel="tokens/s (log scale)",
             xticks=batches)
    left.title.set_fontsize(9)
    most = max(fits.values())
    for (card, curve), color in zip(cards.items(), ("tab:blue", "tab:purple")):  # not the fits'
        right.plot(list(curve), list(curve.values()), color=color,
                   label=f"{card}: bandwidth limit (tokens/s)")
        right.plot(list(fits.values()), [curve[b] for b in fits.values()], "o", color=color)
    for (name, b), color in zip(fits.items(), ("tab:red", "tab:orange", "tab:green")):
        right.axvline(b, color=color, ls=":",
                      label=f"fits 12 GiB at {context:,} tokens: {name} ({b})")
    right.set(title="Qwen3-4B bf16: bandwidth limit, an upper bound, not a forecast",
              ylabel="tokens/s", xlim=(0, most + 1))
    right.title.set_fontsize(9)
    left.set_yscale("log")  # the CPU's batch 1 and its limit differ several-fold
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return fig


def gather_bytes(config, n: int, block: int = 16, itemsize: int = 4) -> int:
    """K and V of ``n + 1`` slots in whole blocks, every layer: what a paged step's views copy."""
    return (2 * config.num_hidden_layers * kv_heads(config) * -(-(n + 1) // block) * block
            * config.head_dim * itemsize)


def filled(model, kind: str, n: int, block: int = 16):
    """A slab or paged cache holding ``n`` slots (zeros), room for slot n, which a step writes."""
    config, device, dtype = model.config, model.device, model.dtype
    cache = (KVCache.for_model(config, n + 1, device=device, dtype=dtype) if kind == "slab" else
             PagedCache(BlockPool.for_model(config, -(-(n + 1) // block), block, device=device,
                                            dtype=dtype)))
    fill(cache, n)
    return cache


def paging_cost(model, token, contexts=(256, 1024, 2048), rounds_n: int = 4):
    """({(kind, n): [ms of each round]}, flagged): at each context, the slab step, the paged step,
    and the paged cache's gathers alone, in rounds (:mod:`course.rounds`), each a median of 5."""
    out = {}
    for n in contexts:
        slab, paged = filled(model, "slab", n), filled(model, "paged", n)

        def gathers(paged=paged, n=n):  # each layer's view, dropped before the next, as in a step
            for layer in range(model.config.num_hidden_layers):
                k, v = paged.view(layer, n + 1)
                del k, v

        calls = {"slab step": partial(kvlib.forward, model, token, slab, n),
                 "paged step": partial(kvlib.forward, model, token, paged, n),
                 "gathers alone": gathers}
        ms = rounds({kind: timed(call, model.device, repeats=5, warmup=1)
                     for kind, call in calls.items()}, rounds_n)
        out |= {(kind, n): [s * 1e3 for s in v] for kind, v in ms.items()}
    return out, disturbed({f"{kind} at {n:,}": v for (kind, n), v in out.items()})


def paging_figure(round_ms: dict, predicted: dict, label: str, flagged: list) -> Figure:
    """What reading pages adds per step: the paged step minus the slab step (round by round) and
    the gathers alone, medians with the range of the rounds, beside the prediction. A disturbed run
    is said once, in the label: no note box sits on the frame."""
    contexts = sorted(predicted)
    extra = {n: [p - s for s, p in zip(round_ms["slab step", n], round_ms["paged step", n])]
             for n in contexts}
    alone = {n: round_ms["gathers alone", n] for n in contexts}
    fig, ax = plots.figure("What reading pages adds per decode step", flag_label(
        f"SmolLM2-135M, pages of 16; medians, bars: range of the rounds · {label}", flagged),
        "context (tokens)", "ms per step", size=(7.5, 4.2))
    step = (contexts[-1] - contexts[0]) / 40  # side by side, so the bars do not hide each other
    for (name, samples, color), shift in zip(
            (("paged step minus slab step, round by round", extra, "tab:blue"),
             ("gathers alone (view(): a new tensor per layer)", alone, "tab:red")), (-step, step)):
        mid = [statistics.median(samples[n]) for n in contexts]
        ax.errorbar([n + shift for n in contexts], mid,
                    yerr=[[m - min(samples[n]) for m, n in zip(mid, contexts)],
                          [max(samples[n]) - m for m, n in zip(mid, contexts)]],
                    fmt="o", capsize=4, color=color, label=name)
    ax.plot(contexts, [predicted[n] for n in contexts], "--", color="0.3",
            label="PREDICTION: 2 x gather bytes / copy bandwidth")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set(xticks=contexts)
    quart = [q for v in (*extra.values(), *alone.values()) for q in np.percentile(v, (25, 75))]
    quart += list(predicted.values())
    pad = 0.3 * (max(quart) - min(quart))  # an outlying round runs off the frame, not the scale
    ax.set_ylim(min(0, min(quart) - pad), max(quart) + pad)
    ax.margins(x=0.08)
    ax.legend(fontsize=7, loc="lower right")
    return fig
