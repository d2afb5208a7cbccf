"""Exercises of notebook 03 (the preallocated cache): checks and reference solutions.

Each ``check_*`` prints exactly ``not attempted yet`` when the learner's function
still raises ``NotImplementedError``, ``correct`` when it is right, and otherwise a
message naming the numbers that differ. Checks run on small CPU tensors or on the
``meta`` device, so they print the same thing on every machine.
"""

from __future__ import annotations

import torch

from kvlib import KVCache
from kvlib.budget import GIB, MIB, load_config
from kvlib.meter import AllocMeter

NOT_ATTEMPTED = "not attempted yet"


# --- 1. the in-place write ---------------------------------------------------------------


def write_solution(k_store: torch.Tensor, v_store: torch.Tensor, layer: int, start: int,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Put ``k``/``v`` ``[n, Hkv, D]`` into slots ``start..start+n`` of ``layer``, in place.

    ``k_store``/``v_store`` are ``[layers, max_seq, Hkv, D]``. A slice assignment is one
    copy into memory that already exists: nothing is allocated.
    """
    n = k.shape[0]
    k_store[layer, start:start + n] = k
    v_store[layer, start:start + n] = v


def check_write(fn) -> None:
    """``fn(k_store, v_store, layer, start, k, v)`` must fill the right slots and allocate nothing."""
    L, S, H, D = 3, 16, 2, 4
    g = torch.Generator().manual_seed(0)
    k_store, v_store = torch.zeros(L, S, H, D), torch.zeros(L, S, H, D)
    want_k, want_v = k_store.clone(), v_store.clone()
    ptr = k_store.data_ptr()
    writes = [(0, 0, 5), (2, 5, 1), (1, 6, 3), (0, 5, 1)]  # (layer, start, n): a prefill, then steps
    with AllocMeter() as meter:
        for layer, start, n in writes:
            k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
            meter.mark()  # the inputs are ours: count only what fn allocates
            try:
                fn(k_store, v_store, layer, start, k, v)
            except NotImplementedError:
                print(NOT_ATTEMPTED)
                return
            spent = meter.mark()
            write_solution(want_k, want_v, layer, start, k, v)
            if spent:
                print(f"write(layer={layer}, start={start}, n={n}) allocated {spent:,} B "
                      f"({meter.by_op}); an in-place write allocates 0 B")
                return
            if k_store.data_ptr() != ptr:
                print("k_store moved to new memory: write into the tensor you were given")
                return
            for name, got, want in (("k", k_store, want_k), ("v", v_store, want_v)):
                if not torch.equal(got, want):
                    wrong = (got != want).any(-1).any(-1).nonzero().tolist()
                    print(f"after write(layer={layer}, start={start}, n={n}): {name} differs "
                          f"at [layer, slot] {wrong[:6]}; slots start..start+n of that layer "
                          f"should hold the new values, every other slot stays as it was")
                    return
    print("correct")


# --- 2. the longest cache a budget holds --------------------------------------------------

BUDGET_CASES = [  # (shipped config, dtype, bytes the cache may take)
    ("qwen3-4b", torch.bfloat16, 4 * GIB),
    ("smollm2-135m", torch.float32, 100 * MIB),
    ("llama-3.2-3b", torch.float16, 3 * GIB // 2 + 123),
]


def max_seq_solution(config, dtype: torch.dtype, budget_bytes: int) -> int:
    """The largest ``max_seq`` whose K and V together fit in ``budget_bytes``."""
    element = torch.empty((), dtype=dtype).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    return budget_bytes // per_token


def _nbytes(config, dtype, max_seq: int) -> int:
    return KVCache.for_model(config, max_seq, device="meta", dtype=dtype).nbytes


def check_max_seq(fn) -> None:
    """``fn(config, dtype, budget_bytes)`` -> the largest max_seq with ``KVCache.nbytes <= budget``."""
    for name, dtype, budget in BUDGET_CASES:
        config = load_config(name)
        try:
            got = int(fn(config, dtype, budget))
        except NotImplementedError:
            print(NOT_ATTEMPTED)
            return
        short = str(dtype).removeprefix("torch.")
        if got < 1 or _nbytes(config, dtype, got) > budget:
            size = _nbytes(config, dtype, got) if got >= 1 else 0
            print(f"{name} in {short}, budget {budget:,} B: max_seq={got:,} makes a cache of "
                  f"{size:,} B, which does not fit")
            return
        if _nbytes(config, dtype, got + 1) <= budget:
            print(f"{name} in {short}, budget {budget:,} B: max_seq={got:,} fits, but so does "
                  f"{got + 1:,} ({_nbytes(config, dtype, got + 1):,} B): find the largest")
            return
    print("correct")
