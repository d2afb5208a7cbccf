"""Exercises of notebook 04 (layout, views and SDPA): checks and reference solutions.

Checks run on small CPU tensors, so they print the same thing on every machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlib import KVCache
from kvlib.budget import weight_bytes
from kvlib.config import GIB, head_dim, kv_bytes_per_token, load_config
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect, hint

# --- 1a. where a head's key sits in storage ---------------------------------------------

OFFSET_CASES = [  # (max_seq, n_kv_heads, head_dim, layer, head, slot)
    (16, 3, 64, 1, 2, 5),  # SmolLM2's KV heads and head_dim, a short cache, the second layer
    (1024, 8, 128, 35, 7, 1000),  # Qwen3-4B's, its last layer
    (7, 2, 5, 3, 1, 6),  # odd numbers catch a formula that only works by accident
]


def view_offset_solution(max_seq: int, n_kv_heads: int, head_dim: int, layer: int, head: int,
                         slot: int, layout: str) -> int:
    """Offset, in elements from the start of the cache's storage, of ``view(layer, ...)[0, head,
    slot]``: the layer index times the layer's size, plus the strides of section 2 times the
    indices. The layers come first in both layouts, so only the inner part differs."""
    layer_start = layer * max_seq * n_kv_heads * head_dim  # [S, H, D] or [H, S, D]: same size
    if layout == "seq":  # storage [L, S, H, D]: one slot is H*D elements, one head D
        return layer_start + slot * n_kv_heads * head_dim + head * head_dim
    # "head": storage [L, H, S, D]: one head is S*D elements, one slot D
    return layer_start + head * max_seq * head_dim + slot * head_dim


def _true_offset(max_seq: int, n_kv_heads: int, head_dim: int, layer: int, head: int, slot: int,
                 layout: str) -> int:
    """Read from a real cache's view (on ``meta``: shapes and strides, no memory)."""
    cache = KVCache(layer + 1, max_seq, n_kv_heads, head_dim, device="meta",
                    dtype=torch.float32, layout=layout)
    k, _ = cache.view(layer, max_seq)  # [1, H, S, D]
    return k[0, head, slot].storage_offset()


@check
def check_view_offset(fn) -> None:
    """``fn(max_seq, n_kv_heads, head_dim, layer, head, slot, layout)`` -> offset in elements."""
    for layout in ("seq", "head"):
        other = "head" if layout == "seq" else "seq"
        for max_seq, heads, dim, layer, head, slot in OFFSET_CASES:
            got = attempt(fn, max_seq, heads, dim, layer, head, slot, layout)
            want = _true_offset(max_seq, heads, dim, layer, head, slot, layout)
            expect(got == want,
                   f"layout={layout!r}, max_seq={max_seq}, kv_heads={heads}, head_dim={dim}, "
                   f"layer {layer}, head {head}, slot {slot}: you said offset {got}, the view "
                   f"has it at {want}.",
                   hint(got, {
                       want - layer * max_seq * heads * dim:
                           "That is layer 0's offset: the layers come first in storage, so "
                           "skip `layer` whole layers of max_seq * kv_heads * head_dim.",
                       _true_offset(max_seq, heads, dim, layer, head, slot, other):
                           f"That is the offset in layout={other!r}: which of slot and head "
                           f"steps by head_dim in this one?",
                   }))


# --- 1b. runs of memory one head's read makes ------------------------------------------

RUN_CASES = [  # (n_kv_heads, t)
    (3, 4),  # the picture's: SmolLM2's KV heads, the step at t = 4
    (8, 100),  # Qwen3-4B's KV heads, a longer read
    (1, 9),  # one KV head (multi-query attention): the picture does not show it
    (4, 0),  # the first step reads one slot
]


def read_runs_solution(n_kv_heads: int, t: int, layout: str) -> int:
    """Separate runs of memory SDPA reads for one head's slots ``0..t`` through the view."""
    if layout == "head" or n_kv_heads == 1:  # one head's slots are neighbours in storage
        return 1
    return t + 1  # "seq": the next slot of the same head is Hkv * D elements further on


def _true_runs(n_kv_heads: int, t: int, layout: str) -> int:
    """Counted from a real cache's storage offsets: a run ends where the next key is not next."""
    cache = KVCache(1, t + 2, n_kv_heads, 4, device="cpu", dtype=torch.float32, layout=layout)
    size = 4 * cache.k.element_size()  # bytes of one key vector
    starts = sorted(cache.k[0, s, n_kv_heads - 1].data_ptr() // size for s in range(t + 1))
    return 1 + sum(b != a + 1 for a, b in zip(starts, starts[1:]))


@check
def check_read_runs(fn) -> None:
    """``fn(n_kv_heads, t, layout)`` -> how many separate runs of memory one head's read makes."""
    for layout in ("seq", "head"):
        for heads, t in RUN_CASES:
            got = attempt(fn, heads, t, layout)
            want = _true_runs(heads, t, layout)
            expect(got == want,
                   f"layout={layout!r}, kv_heads={heads}, t={t}: you said {got} run(s), SDPA's "
                   f"read of one head's slots 0..{t} makes {want}.",
                   hint(got, {
                       t + 1: "With one KV head, what sits between two slots of the same head?"
                       if heads == 1 else "Head-major storage keeps one head's slots together.",
                       1: "Seq-major storage puts the other heads' keys between two slots of "
                          "one head.",
                   }))


# --- 2. the context repeat_kv's copy costs ----------------------------------------------


def repeat_kv_limit_solution(config, dtype: torch.dtype, budget_bytes: int) -> int:
    """Longest context at which the weights, the whole cache and one layer's ``repeat_kv`` copy of
    K and V fit in ``budget_bytes``. Both the cache and the copy grow by a fixed number of bytes
    per token, so the answer is what the weights leave, divided by their sum."""
    d, element = head_dim(config), dtype.itemsize
    cache_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * d * element
    copy_per_token = 2 * config.num_attention_heads * d * element  # query heads, one layer
    return (budget_bytes - weight_bytes(config, dtype)) // (cache_per_token + copy_per_token)


def _measured_copy_per_token(config, dtype: torch.dtype) -> int:
    """Bytes ``repeat_kv`` allocates for one layer's K and V, per token, counted by the meter."""
    from transformers.models.llama.modeling_llama import repeat_kv

    h_kv, h_q, d = config.num_key_value_heads, config.num_attention_heads, head_dim(config)
    seq = 1024
    k = torch.empty(1, h_kv, seq, d, dtype=dtype, device="meta")  # meta: shapes, no memory
    v = torch.empty(1, h_kv, seq, d, dtype=dtype, device="meta")
    with AllocMeter() as meter:
        repeat_kv(k, h_q // h_kv)
        repeat_kv(v, h_q // h_kv)
    return meter.total // seq


LIMIT_CASES = [("qwen3-4b", torch.bfloat16, 12 * GIB), ("llama-3.2-3b", torch.float16, 12 * GIB),
               ("smollm2-135m", torch.float32, 1 * GIB)]


@check
def check_repeat_kv_limit(fn) -> str:
    """``fn(config, dtype, budget_bytes)`` -> longest context with one layer's copy alongside."""
    notes = []  # the first case's is printed: Qwen3-4B on 12 GiB
    for name, dtype, budget in LIMIT_CASES:
        config = load_config(name)
        weights = weight_bytes(config, dtype)
        cache, copy = kv_bytes_per_token(config, dtype), _measured_copy_per_token(config, dtype)
        free, group = budget - weights, config.num_attention_heads // config.num_key_value_heads
        want, without = free // (cache + copy), free // cache
        got = int(attempt(fn, config, dtype, budget))
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')} on {budget / GIB:g} GiB: you said "
               f"{got:,} tokens, the longest that fits is {want:,} (weights {weights:,} B; per "
               f"token: cache {cache:,} B, one layer's copy {copy:,} B as the meter counts it).",
               hint(got, {
                   without: "That is the limit without the copy: add its bytes per token.",
                   free // (cache + copy * config.num_hidden_layers):
                       "The copy is made and freed layer by layer: one layer's is live at a time.",
                   free // (cache + copy // group):
                       "The copy holds the query heads (Hq), not the KV heads it repeats.",
                   budget // (cache + copy): "The weights are on the card too.",
               }))
        notes.append(f"{name}: {without:,} tokens without the copy, {want:,} with it "
                     f"({1 - want / without:.0%} fewer; the copy per token is group/L = "
                     f"{group}/{config.num_hidden_layers} of the cache's)")
    return notes[0]


# --- 3. attention for a chunk of prefill, folded ---------------------------------------


def chunk_attention_solution(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             t: int) -> torch.Tensor:
    """A chunk's attention, q ``[1, Hq, n, D]`` at slots ``t..t+n``, k/v ``[1, Hkv, t+n, D]``.

    Query head ``h`` uses KV head ``h // group`` (``enable_gqa``'s rule), so the ``group`` query
    heads of one KV head are neighbours: ``reshape`` puts query ``i`` of the ``g``-th head of a
    group in row ``g * n + i``. Query ``i`` sees slots ``0..t+i``; the mask of the folded rows is
    that ``[n, t+n]`` mask once per group member, stacked (``repeat``, not ``repeat_interleave``).
    """
    _, h_q, n, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    folded = q.reshape(1, h_kv, group * n, d)  # [1, Hkv, group*n, D]
    visible = torch.ones(n, t + n, dtype=torch.bool, device=q.device).tril(t)  # [n, t+n]
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=visible.repeat(group, 1))
    return out.reshape(1, h_q, n, d)


CHUNK_CASES = [  # (Hq, Hkv, n, t, D): the first is SmolLM2's heads after a long context
    (9, 3, 4, 508, 64), (32, 8, 3, 13, 16), (4, 2, 5, 0, 8), (6, 6, 2, 3, 8)]


def _chunk_inputs(h_q: int, h_kv: int, n: int, t: int, d: int):
    """q ``[1, Hq, n, D]``, and k/v as a seq-major cache's permuted view ``[1, Hkv, t+n, D]``."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h_q, n, d, generator=g)
    store_k = torch.randn(t + n, h_kv, d, generator=g)  # [S, Hkv, D] storage
    store_v = torch.randn(t + n, h_kv, d, generator=g)
    return q, store_k.permute(1, 0, 2).unsqueeze(0), store_v.permute(1, 0, 2).unsqueeze(0)


def _chunk_reference(q, k, v, t: int) -> torch.Tensor:
    n = q.shape[2]
    visible = torch.ones(n, t + n, dtype=torch.bool).tril(t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


@check
def check_chunk_attention(fn) -> None:
    """``fn(q, k, v, t)`` must equal ``enable_gqa`` with the chunk's mask, and copy no K or V."""
    for case in CHUNK_CASES:
        h_q, h_kv, n, t, d = case
        q, k, v = _chunk_inputs(*case)
        want = _chunk_reference(q, k, v, t)
        # the CPU's fused kernel: it reads strided K/V in place, so any copy is yours
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), AllocMeter() as meter:
            got = attempt(fn, q, k, v, t)
        where = f"Hq={h_q}, Hkv={h_kv}, n={n} queries after t={t} slots, D={d}"
        expect(tuple(got.shape) == tuple(want.shape),
               f"{where}: output shape {tuple(got.shape)}, expected {tuple(want.shape)} "
               f"([1, Hq, n, D])")
        err = (got - want).abs().max().item()
        expect(err <= 1e-5, f"{where}: output differs from enable_gqa=True by up to {err:.3g}. "
                            f"Which folded row is query i of which head? Does query i see slots "
                            f"0..t+i?")
        kv_bytes = k.numel() * k.element_size()
        expect(case != CHUNK_CASES[0] or meter.total < kv_bytes,
               f"{where}: same output, but your function allocated {meter.total:,} B, at least "
               f"one K or V ({kv_bytes:,} B): something copied K/V ({meter.by_op})")
