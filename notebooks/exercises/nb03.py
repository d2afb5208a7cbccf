"""Exercises of notebook 03 (the preallocated cache): checks and reference solutions.

Checks run on small CPU tensors or on the ``meta`` device, so they print the same thing on
every machine.
"""

from __future__ import annotations

import torch

from kvlib.meter import AllocMeter

from .checking import attempt, check, expect

# --- 1. the in-place write, "head" layout -------------------------------------------------


def write_solution(k_store: torch.Tensor, v_store: torch.Tensor, layer: int, start: int,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Put ``k``/``v`` ``[n, Hkv, D]`` into slots ``start..start+n`` of ``layer``, in place.

    ``k_store``/``v_store`` are ``[layers, Hkv, max_seq, D]`` (kvlib's ``"head"`` layout), so
    the new slots are ``[Hkv, n, D]``: assign the transposed view. A slice assignment is one
    strided copy into memory that already exists: nothing is allocated.
    """
    n = k.shape[0]
    k_store[layer, :, start:start + n] = k.transpose(0, 1)  # [Hkv, n, D]
    v_store[layer, :, start:start + n] = v.transpose(0, 1)


@check
def check_write(fn) -> None:
    """``fn(k_store, v_store, layer, start, k, v)``: the right slots filled, nothing allocated."""
    L, H, S, D = 3, 2, 16, 4
    g = torch.Generator().manual_seed(0)
    k_store, v_store = torch.zeros(L, H, S, D), torch.zeros(L, H, S, D)
    want_k, want_v = k_store.clone(), v_store.clone()
    ptr = k_store.data_ptr()
    writes = [(0, 0, 5), (2, 5, 1), (1, 6, 3), (0, 5, 1)]  # (layer, start, n): a prefill, steps
    for layer, start, n in writes:
        k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
        with AllocMeter() as meter:  # the inputs are ours: count only what fn allocates
            attempt(fn, k_store, v_store, layer, start, k, v)
        write_solution(want_k, want_v, layer, start, k, v)
        where = f"write(layer={layer}, start={start}, n={n})"
        expect(not meter.total, f"{where} allocated {meter.total:,} B ({meter.by_op}); "
                                f"an in-place write allocates 0 B")
        expect(k_store.data_ptr() == ptr,
               "k_store moved to new memory: write into the tensor you were given")
        for name, got, want in (("k", k_store, want_k), ("v", v_store, want_v)):
            wrong = (got != want).any(-1).any(1).nonzero().tolist()  # [layer, slot] pairs
            expect(not wrong, f"after {where}: {name} differs at [layer, slot] {wrong[:6]}; "
                              f"slots start..start+n of that layer (the third axis of the "
                              f"store) should hold the new values, every other slot stays as "
                              f"it was")


# --- 2. the view attention reads, "head" layout ---------------------------------------------


def view_solution(k_store: torch.Tensor, layer: int, seq: int) -> torch.Tensor:
    """``[1, Hkv, seq, D]``: the first ``seq`` slots of ``layer``, a view of ``[L, Hkv, S, D]``."""
    return k_store[layer, :, :seq].unsqueeze(0)


@check
def check_view(fn) -> None:
    """``fn(k_store, layer, seq)`` -> a ``[1, Hkv, seq, D]`` view of the store, 0 B allocated."""
    L, H, S, D = 3, 2, 16, 4
    k_store = torch.randn(L, H, S, D, generator=torch.Generator().manual_seed(1))
    for layer, seq in ((0, 5), (2, 16), (1, 1)):
        with AllocMeter() as meter:
            got = attempt(fn, k_store, layer, seq)
        want = view_solution(k_store, layer, seq)
        where = f"view(layer={layer}, seq={seq})"
        expect(tuple(got.shape) == tuple(want.shape),
               f"{where}: shape {tuple(got.shape)}, want [1, kv_heads, seq, head_dim] = "
               f"{tuple(want.shape)}")
        expect(torch.equal(got, want),
               f"{where}: right shape, wrong values: take slots 0..{seq} of layer {layer}")
        expect(not meter.total,
               f"{where} allocated {meter.total:,} B ({meter.by_op}): a view allocates 0 B")
        base = k_store.data_ptr()
        expect(got.data_ptr() == want.data_ptr(),
               f"{where}: starts at byte {got.data_ptr() - base:,} of the store, "
               f"want {want.data_ptr() - base:,}: it must be a view into k_store")
        expect(got.stride()[1:] == want.stride()[1:],
               f"{where}: strides {got.stride()}, want {want.stride()} (the store's own strides)")
