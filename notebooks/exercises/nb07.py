"""Exercises of notebook 07 (many requests: batches and paged blocks): checks and solutions.

Checks run on small CPU tensors and shipped configs, so they print the same thing everywhere.
"""

from __future__ import annotations

import torch

from kvlib.config import head_dim, kv_heads, kv_token_bytes, load_config

from .checking import attempt, check, expect, hint

# --- 1. the block table: where does slot t live? -----------------------------------------


def lookup_solution(table: list[int], block: int, slot: int) -> tuple[int, int]:
    """``(physical block, offset)`` of logical slot ``slot``: logical block ``slot // block`` is
    ``table[slot // block]``, and the slot sits ``slot % block`` into it."""
    return table[slot // block], slot % block


LOOKUP_CASES = [([7, 2, 9], 4, 6), ([7, 2, 9], 4, 0), ([7, 2, 9], 4, 11), ([3, 0], 16, 16),
                ([5], 1, 0), ([4, 1, 6, 0], 3, 7)]


@check
def check_lookup(fn) -> None:
    """``fn(table, block, slot)`` -> ``(physical block, offset)``."""
    for table, block, slot in LOOKUP_CASES:
        got = attempt(fn, list(table), block, slot)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        want = lookup_solution(table, block, slot)
        logical, offset = slot // block, slot % block
        known = {(logical, offset): "That is the logical block: look it up in the table.",
                 (offset, logical): "The offset is slot % block, the block slot // block.",
                 (table[slot // block], slot): "The offset counts from the block's first slot."}
        expect(got == want,
               f"table {table}, block {block}, slot {slot}: you said {got}, want {want}.",
               hint(got, known))


# --- 2. reading a request's blocks -----------------------------------------------------------


def gather_solution(pool_k: torch.Tensor, table: list[int], seq: int) -> torch.Tensor:
    """``[1, Hkv, seq, D]`` from ``pool_k`` ``[Hkv, n_blocks, block, D]``: the table's blocks in
    table order, laid end to end, cut to ``seq`` slots. ``index_select`` copies them (a gather)."""
    Hkv, _, block, D = pool_k.shape
    n = -(-seq // block)  # the blocks that hold slots 0..seq
    index = torch.tensor(table[:n], dtype=torch.long)
    return pool_k.index_select(1, index).reshape(1, Hkv, n * block, D)[:, :, :seq]


@check
def check_gather(fn) -> None:
    """``fn(pool_k, table, seq)`` -> the request's ``[1, Hkv, seq, D]`` keys."""
    g = torch.Generator().manual_seed(7)
    pool_k = torch.randn(2, 6, 4, 3, generator=g)  # [Hkv, n_blocks, block, D]
    for table, seq in (([3, 0, 5], 10), ([1], 4), ([4, 2], 5), ([0, 1, 2], 1), ([5, 3, 1, 0], 16)):
        got = attempt(fn, pool_k, list(table), seq)
        want = gather_solution(pool_k, table, seq)
        where = f"table {table}, seq {seq}"
        expect(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape),
               f"{where}: shape {None if got is None else tuple(getattr(got, 'shape', ()))}, "
               f"want [1, Hkv, seq, D] = {tuple(want.shape)}")
        by_number = gather_solution(pool_k, sorted(table[: -(-seq // 4)]), seq)
        expect(torch.equal(got, want), f"{where}: right shape, wrong values. " + (
            "Follow the table's order, not the blocks' numbers." if torch.equal(got, by_number)
            else "Slot t is at block table[t // block], offset t % block."))


# --- 3. tensor parallelism: KV bytes per token on each GPU -----------------------------------


def kv_per_gpu_solution(config, dtype: torch.dtype, tp: int) -> int:
    """Each of ``tp`` GPUs holds ``ceil(Hkv / tp)`` KV heads of every layer: the heads are split,
    and past ``Hkv`` GPUs a head is copied, not split further."""
    heads = -(-kv_heads(config) // tp)
    return kv_token_bytes(config.num_hidden_layers, heads, head_dim(config), dtype)


TP_CASES = [("qwen3-4b", torch.bfloat16, 1), ("qwen3-4b", torch.bfloat16, 2),
            ("qwen3-4b", torch.bfloat16, 8), ("qwen3-4b", torch.bfloat16, 16),
            ("smollm2-135m", torch.float32, 2), ("llama-3.2-3b", torch.float16, 4)]


@check
def check_kv_per_gpu(fn) -> None:
    """``fn(config, dtype, tp)`` -> KV bytes per token on each GPU, all layers, K and V."""
    for name, dtype, tp in TP_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, tp)
        want = kv_per_gpu_solution(config, dtype, tp)
        whole = kv_per_gpu_solution(config, dtype, 1)
        expect(got == want,
               f"{name} ({kv_heads(config)} KV heads) in {str(dtype).removeprefix('torch.')}, "
               f"tp={tp}: you said {got}, want {want:,} B per token per GPU "
               f"({whole:,} B on one GPU).",
               hint(got, {whole / tp: "A GPU cannot hold a fraction of a head: past Hkv GPUs each "
                                      "still holds one whole head.",
                          whole: "The KV heads are split across the GPUs."}))
