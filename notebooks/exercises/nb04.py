"""Exercises of notebook 04 (layout, views and SDPA): checks and reference solutions.

Checks run on small CPU tensors, so they print the same thing on every machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlib import KVCache
from kvlib.config import head_dim, load_config
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect

# --- 1. strides of the view SDPA gets ---------------------------------------------------

STRIDE_CASES = [  # (max_seq, n_kv_heads, head_dim)
    (16, 3, 64),  # SmolLM2's KV heads and head_dim, a short cache
    (1024, 8, 128),  # Qwen3-4B's
    (7, 2, 5),  # odd numbers catch a formula that only works by accident
]


def view_strides_solution(max_seq: int, n_kv_heads: int, head_dim: int, layout: str) -> tuple:
    """Strides, in elements, of the ``[heads, seq, head_dim]`` dims of ``KVCache.view``."""
    if layout == "seq":  # storage [L, S, H, D]: one slot is H*D elements, one head D
        return (head_dim, n_kv_heads * head_dim, 1)
    # "head": storage [L, H, S, D]: one head is S*D elements, one slot D
    return (max_seq * head_dim, head_dim, 1)


def _true_strides(max_seq: int, n_kv_heads: int, head_dim: int, layout: str) -> tuple:
    cache = KVCache(1, max_seq, n_kv_heads, head_dim, device="meta", dtype=torch.float32,
                    layout=layout)
    k, _ = cache.view(0, max_seq)  # [1, H, S, D]
    return tuple(k.stride()[1:])


@check
def check_view_strides(fn) -> None:
    """``fn(max_seq, n_kv_heads, head_dim, layout)`` -> strides of (heads, seq, head_dim)."""
    for layout in ("seq", "head"):
        for max_seq, heads, dim in STRIDE_CASES:
            got = attempt(fn, max_seq, heads, dim, layout)
            want = _true_strides(max_seq, heads, dim, layout)
            expect(tuple(int(x) for x in got) == want,
                   f"layout={layout!r}, max_seq={max_seq}, kv_heads={heads}, head_dim={dim}: "
                   f"you said strides {tuple(got)}, the view has {want}. Hint: a stride is how "
                   f"many elements you skip in storage to move one step along that dim.")


# --- 2. what repeat_kv allocates -------------------------------------------------------


def repeat_kv_bytes_solution(config, seq: int, dtype: torch.dtype) -> int:
    """Bytes ``repeat_kv`` allocates for K *and* V of one layer at ``seq`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_attention_heads * seq * head_dim(config) * element


def _measured_repeat_bytes(config, seq: int, dtype: torch.dtype) -> int:
    from transformers.models.llama.modeling_llama import repeat_kv

    h_kv, h_q, d = config.num_key_value_heads, config.num_attention_heads, head_dim(config)
    k = torch.empty(1, h_kv, seq, d, dtype=dtype, device="meta")  # meta: shapes, no memory
    v = torch.empty(1, h_kv, seq, d, dtype=dtype, device="meta")
    with AllocMeter() as meter:
        repeat_kv(k, h_q // h_kv)
        repeat_kv(v, h_q // h_kv)
    return meter.total


REPEAT_CASES = [("qwen3-4b", 32768, torch.bfloat16), ("smollm2-135m", 2048, torch.float32),
                ("llama-3.2-3b", 8192, torch.float16)]


@check
def check_repeat_kv_bytes(fn) -> None:
    """``fn(config, seq, dtype)`` -> bytes repeat_kv allocates for one layer's K and V."""
    for name, seq, dtype in REPEAT_CASES:
        config = load_config(name)
        got = int(attempt(fn, config, seq, dtype))
        want = _measured_repeat_bytes(config, seq, dtype)
        expect(got == want,
               f"{name} at {seq} tokens in {str(dtype).removeprefix('torch.')}: you predicted "
               f"{got:,} B, the meter counted {want:,} B for K and V of one layer "
               f"({config.num_attention_heads} query heads, {config.num_key_value_heads} KV "
               f"heads, head_dim {head_dim(config)}).")


# --- 3. GQA by folding query heads -----------------------------------------------------


def gqa_fold_solution(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode attention, q ``[1, Hq, 1, D]``, k/v ``[1, Hkv, S, D]`` -> ``[1, Hq, 1, D]``.

    Query head ``i`` uses KV head ``i // group`` (``enable_gqa``'s rule), so the
    ``group`` query heads of one KV head are neighbours: view them as ``group``
    query *positions* of that head. K and V are used as they are.
    """
    _, h_q, n, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    q_folded = q.reshape(1, h_kv, group * n, d)  # [1, Hkv, group*1, D], a view for n == 1
    out = F.scaled_dot_product_attention(q_folded, k, v)  # [1, Hkv, group, D]
    return out.reshape(1, h_q, n, d)


def _gqa_inputs(seed: int = 0):
    """SmolLM2's heads (9 query, 3 KV, head_dim 64) over the original design's permuted view."""
    g = torch.Generator().manual_seed(seed)
    seq, h_q, h_kv, d = 512, 9, 3, 64
    q = torch.randn(1, h_q, 1, d, generator=g)
    store_k = torch.randn(seq, h_kv, d, generator=g)  # the original design's [S, Hkv, D]
    store_v = torch.randn(seq, h_kv, d, generator=g)
    return q, store_k.permute(1, 0, 2).unsqueeze(0), store_v.permute(1, 0, 2).unsqueeze(0)


@check
def check_gqa_fold(fn) -> None:
    """``fn(q, k, v)`` must equal ``enable_gqa=True`` and allocate no copy of K or V."""
    q, k, v = _gqa_inputs()
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    kv_bytes = k.numel() * k.element_size()
    # the CPU's fused kernel: it reads strided K/V in place, so any copy is yours
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), AllocMeter() as meter:
        got = attempt(fn, q, k, v)
    expect(tuple(got.shape) == tuple(want.shape),
           f"output shape {tuple(got.shape)}, expected {tuple(want.shape)} ([1, Hq, 1, D])")
    err = (got - want).abs().max().item()
    expect(err <= 1e-5, f"output differs from enable_gqa=True by up to {err:.3g}: is query head i "
                        f"paired with KV head i // group (not i % n_kv_heads)?")
    expect(meter.total < kv_bytes,
           f"same output, but your function allocated {meter.total:,} B, at least one K or V "
           f"({kv_bytes:,} B): something copied K/V ({meter.by_op})")
