"""Exercises of notebook 03 (the preallocated cache): checks and reference solutions.

Checks run on small CPU tensors or on the ``meta`` device, so they print the same thing on
every machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlib.meter import AllocMeter

from .checking import attempt, check, expect, hint

# --- 1. the in-place write, "head" layout -------------------------------------------------


def write_solution(k_store: torch.Tensor, v_store: torch.Tensor, layer: int, start: int,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Put ``k``/``v`` ``[n, Hkv, D]`` into slots ``start:start+n`` of ``layer``, in place.

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
                              f"slots start:start+n of that layer (the third axis of the "
                              f"store) should hold the new values, every other slot stays as "
                              f"it was")


# --- 2. the view attention reads, "head" layout ---------------------------------------------

VIEW_STORE = (3, 2, 16, 4)  # the checks' store: [layers, kv_heads, max_seq, head_dim], fp32
VIEW_CALL = (2, 5)  # the prediction's call: view(k_store, layer=2, seq=5)


def view_prediction_solution() -> tuple[int, tuple[int, int, int]]:
    """Where ``view(k_store, 2, 5)`` starts in a ``[3, 2, 16, 4]`` fp32 store, in bytes from its
    first byte, and the strides (elements) of the view's heads, slots and head_dim axes.

    Head-major storage: one layer is ``2 * 16 * 4`` = 128 elements, so layer 2 starts at element
    256, byte 1,024 (fp32: 4 B each). Within a layer, one head is 16 slots of 4 values (stride
    64), one slot is 4 values (stride 4), one value 1. Slicing to 5 slots changes none of these.
    """
    layers, heads, slots, dim = VIEW_STORE
    layer, _ = VIEW_CALL
    return layer * heads * slots * dim * 4, (slots * dim, dim, 1)


@check
def check_view_prediction(fn) -> None:
    """``fn()`` -> ``(start_byte, (head, slot, head_dim strides))``, predicted before ``view``."""
    got = attempt(fn)
    layers, heads, slots, dim = VIEW_STORE
    layer, seq = VIEW_CALL
    store = torch.zeros(VIEW_STORE)
    view = view_solution(store, layer, seq)
    start, strides = view.data_ptr() - store.data_ptr(), tuple(view.stride()[1:])
    expect(isinstance(got, tuple) and len(got) == 2,
           f"you returned {got!r}: return two things, (start_byte, (3 strides)); the view "
           f"starts at byte {start:,} and has strides {strides}.")
    got_start, got_strides = got
    where = f"view(k_store, layer={layer}, seq={seq}) of a {list(VIEW_STORE)} fp32 store"
    expect(got_start == start,
           f"{where}: you predicted it starts at byte {got_start!r}; it starts at byte {start:,}.",
           hint(got_start, {
               start // 4: "That counts elements: fp32 is 4 bytes each.",
               (layer - 1) * heads * slots * dim * 4: "That is where layer 1 starts: layers "
                                                     "count from 0.",
               layer * seq * heads * dim * 4: "A layer holds all its max_seq = 16 slots, not the "
                                              "5 the view reads.",
           }))
    expect(isinstance(got_strides, tuple | list) and len(got_strides) == 3,
           f"{where}: you predicted strides {got_strides!r}; give three numbers, for heads, "
           f"slots and head_dim (the view has {strides}).")
    expect(tuple(got_strides) == strides,
           f"{where}: you predicted strides {tuple(got_strides)!r} for (heads, slots, head_dim); "
           f"the view has {strides}.",
           hint(tuple(got_strides), {
               (dim, heads * dim, 1): "Those are the \"seq\" layout's ([L, S, H, D]); this store "
                                      "is head-major, [L, H, S, D].",
               (seq * dim, dim, 1): "Slicing to the first 5 slots is a view: the strides stay "
                                    "the store's, with max_seq = 16 slots per head.",
           }))


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
               f"{where}: right shape, wrong values: take slots 0:{seq} of layer {layer}")
        expect(not meter.total,
               f"{where} allocated {meter.total:,} B ({meter.by_op}): a view allocates 0 B")
        base = k_store.data_ptr()
        expect(got.data_ptr() == want.data_ptr(),
               f"{where}: starts at byte {got.data_ptr() - base:,} of the store, "
               f"want {want.data_ptr() - base:,}: it must be a view into k_store")
        expect(got.stride()[1:] == want.stride()[1:],
               f"{where}: strides {got.stride()}, want {want.stride()} (the store's own strides)")


# --- 3. a sliding window: a ring of slots -----------------------------------------------------


class RingCacheSolution:
    """The last ``window`` tokens of every layer in a fixed ``[L, Hkv, window, D]`` store ("head"
    layout): the token at position ``p`` lives in slot ``p % window``, overwriting the one
    ``window`` positions before it.

    The view hands out the slots in storage order, not in time order: attention is a weighted
    sum over keys, and RoPE already put each key's position into the key itself, so the order of
    the slots changes nothing.
    """

    def __init__(self, n_layers: int, window: int, n_kv_heads: int, head_dim: int) -> None:
        self.window = window
        self.k = torch.zeros(n_layers, n_kv_heads, window, head_dim)  # [L, Hkv, W, D]
        self.v = torch.zeros(n_layers, n_kv_heads, window, head_dim)

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v``: ``[1, Hkv, D]``, the token at position ``pos``."""
        s = pos % self.window
        self.k[layer, :, s : s + 1] = k.transpose(0, 1)  # a slice, as KVCache writes: [Hkv, 1, D]
        self.v[layer, :, s : s + 1] = v.transpose(0, 1)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, Hkv, min(seq, window), D]`` after ``seq`` tokens: the slots written so far."""
        held = min(seq, self.window)
        return self.k[layer, :, :held].unsqueeze(0), self.v[layer, :, :held].unsqueeze(0)


RING = (2, 8, 2, 4, 30)  # layers, window, kv_heads, head_dim, tokens written


@check
def check_ring_cache(cls) -> None:
    """``cls(n_layers, window, n_kv_heads, head_dim)`` with ``write(layer, pos, k, v)`` and
    ``view(layer, seq)``: attention over its view equals attention over the last ``window``
    tokens, at every position, with 0 B allocated by writes and views."""
    L, W, H, D, tokens = RING
    g = torch.Generator().manual_seed(2)
    ring = attempt(cls, L, W, H, D)
    past_k = torch.randn(L, tokens, H, D, generator=g)
    past_v = torch.randn(L, tokens, H, D, generator=g)
    query = torch.randn(1, H, 1, D, generator=g)  # one query per KV head
    for pos in range(tokens):
        for layer in range(L):
            with AllocMeter() as meter:
                attempt(ring.write, layer, pos,
                        past_k[layer, pos : pos + 1], past_v[layer, pos : pos + 1])
            expect(not meter.total, f"write(layer={layer}, pos={pos}) allocated {meter.total:,} B "
                                    f"({meter.by_op}): write into the store in place")
            with AllocMeter() as meter:
                keys, values = attempt(ring.view, layer, pos + 1)
            where = f"view(layer={layer}, seq={pos + 1}) with window {W}"
            want_shape = (1, H, min(pos + 1, W), D)
            expect(tuple(keys.shape) == want_shape,
                   f"{where}: shape {tuple(keys.shape)}, want {want_shape}")
            expect(not meter.total, f"{where} allocated {meter.total:,} B ({meter.by_op}): a "
                                    f"view allocates 0 B (the order of the slots does not matter)")
            first = max(0, pos + 1 - W)  # the window: positions first to pos
            want = F.scaled_dot_product_attention(
                query, past_k[layer, first : pos + 1].transpose(0, 1)[None],
                past_v[layer, first : pos + 1].transpose(0, 1)[None])
            got = F.scaled_dot_product_attention(query, keys, values)
            expect(torch.allclose(got, want, atol=1e-5),
                   f"{where}: attention over your view differs from attention over positions "
                   f"{first} to {pos} by {(got - want).abs().max().item():.3g}: the view must hold "
                   f"exactly the last {W} tokens")
