"""Exercises of notebook 02 (the ``cat`` cache): checks and reference solutions.

The answers are checked against a real :class:`kvlib.CatCache`, with the meter or a ledger of
live bytes, on the ``meta`` device (shapes, no memory) or on small CPU tensors, so the checks
print the same thing on every machine and take little time.
"""

from __future__ import annotations

import math

import torch

from course.simulate import Ledger
from kvlib import CatCache
from kvlib.config import head_dim, load_config
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _metered_peak(config, dtype: torch.dtype, t: int) -> tuple[int, int]:
    """(most cache bytes alive at once, cache bytes after) over one decode step of a CatCache
    that holds ``t`` tokens. A ledger of live storages, not the meter: the meter sums what is
    allocated, and the question is what is alive together."""
    cache = CatCache.for_model(config, device="meta", dtype=dtype)
    hkv, d = config.num_key_value_heads, head_dim(config)
    one = torch.empty(1, hkv, d, dtype=dtype, device="meta")  # [1, Hkv, D]: the step's token
    ledger = Ledger()  # counts from 0: only what is made inside
    with ledger:
        if t:  # the t slots held: made here so that their release is counted too
            held = torch.empty(t, hkv, d, dtype=dtype, device="meta")
            for layer in range(cache.n_layers):
                cache.write(layer, 0, held, held)
            del held  # the fill's peak (the cache and this input) stays below the step's
        for layer in range(cache.n_layers):
            cache.write(layer, t, one, one)
    return ledger.peak, ledger.live


# --- 1. the peak inside a step ------------------------------------------------------------


def step_peak_solution(config, dtype: torch.dtype, t: int) -> int:
    """Most cache bytes alive at once during the cat cache's decode step at ``t`` slots held.

    Layers are written one after another, K then V, and each old tensor is freed as soon as its
    longer copy replaces it. So at the last write (the last layer's V) every tensor already has
    ``t + 1`` slots and the old V of ``t`` slots is still alive: the cache after the step plus
    one layer's K (or V) before it, ``(2 * layers * (t + 1) + t) * kv_heads * head_dim * elt``.
    """
    element = torch.empty((), dtype=dtype).element_size()
    one_slot = config.num_key_value_heads * head_dim(config) * element  # one layer's K, one slot
    return (2 * config.num_hidden_layers * (t + 1) + t) * one_slot


PEAK_CASES = [  # (shipped config, dtype, t: slots held before the step)
    ("smollm2-135m", torch.float32, 0),  # nothing old to free: the peak is the cache after
    ("smollm2-135m", torch.float32, 100),
    ("llama-3.2-3b", torch.float16, 4_095),
    ("qwen3-4b", torch.bfloat16, 31_170),  # deep into a 12 GiB card, short of its plan's limit
]


@check
def check_step_peak(fn) -> str:
    """``fn(config, dtype, t)`` -> the most cache bytes alive at once during the step at ``t``."""
    for name, dtype, t in PEAK_CASES:
        config = load_config(name)
        got = int(attempt(fn, config, dtype, t))
        peak, after = _metered_peak(config, dtype, t)
        extra = got - after
        expect(got == peak, f"{name} in {_short(dtype)} at t={t:,}: you said {got:,} B, the ledger "
                            f"saw {peak:,} B alive at once ({after:,} B after the step, so the "
                            f"moment holds {peak - after:,} B more; yours {extra:,} B more)")
    name, dtype, t = PEAK_CASES[-1]
    peak, after = _metered_peak(load_config(name), dtype, t)
    return (f"{name} at t={t:,}: {peak / 2**30:.3f} GiB alive at the last write, "
            f"{(peak - after) / 2**20:.1f} MiB above the cache after the step")


# --- 2. a cache that grows by doubling ----------------------------------------------------


class DoublingCacheSolution:
    """Per layer K and V ``[1, H, capacity, D]``, of which the first ``held[layer]`` slots are
    valid. A write that fits goes in place; one that does not first doubles the capacity (at
    least to fit), copying the valid slots once. Like a Python list: a copy every time the size
    doubles, so the bytes copied over a run stay under twice the final size, not quadratic.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int) -> None:
        empty = torch.zeros(1, n_kv_heads, 0, head_dim)  # [1, H, 0, D], fp32
        self.k, self.v = [empty] * n_layers, [empty] * n_layers
        self.held = [0] * n_layers

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        if end > self.k[layer].shape[2]:  # grow: one allocation and one copy of the valid slots
            capacity = max(end, 2 * self.k[layer].shape[2])
            for store in (self.k, self.v):
                old = store[layer]
                store[layer] = old.new_zeros(1, old.shape[1], capacity, old.shape[3])
                store[layer][:, :, :start] = old[:, :, :start]
        self.k[layer][0, :, start:end] = k.transpose(0, 1)  # [H, n, D], in place
        self.v[layer][0, :, start:end] = v.transpose(0, 1)
        self.held[layer] = end

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :, :seq], self.v[layer][:, :, :seq]  # [1, H, seq, D], views


GROW = (2, 3, 4, 5, 300)  # layers, kv_heads, head_dim, prompt tokens, one-token steps


@check
def check_doubling_cache(cls) -> str:
    """``cls(n_layers, n_kv_heads, head_dim)`` with ``write`` and ``view``: the same views as a
    ``cat`` cache, 0 B per step except when it grows, and it grows about log2(length) times."""
    L, H, D, prompt, steps = GROW
    g = torch.Generator().manual_seed(0)
    cache = attempt(cls, L, H, D)
    reference = CatCache(L, H, D, device="cpu", dtype=torch.float32)
    writes = [(0, torch.randn(prompt, H, D, generator=g), torch.randn(prompt, H, D, generator=g))]
    writes += [(prompt + i, torch.randn(1, H, D, generator=g), torch.randn(1, H, D, generator=g))
               for i in range(steps)]
    grew, total = 0, 0
    for start, k, v in writes:
        with AllocMeter() as meter:
            for layer in range(L):
                attempt(cache.write, layer, start, k, v)
        for layer in range(L):
            reference.write(layer, start, k, v)
        grew, total = grew + bool(meter.total), total + meter.total
        seq = start + k.shape[0]
        for layer in range(L):
            with AllocMeter() as meter:
                got = attempt(cache.view, layer, seq)
            want = reference.view(layer, seq)
            where = f"after the write of slots {start}..{seq}, view(layer={layer}, seq={seq})"
            expect(tuple(got[0].shape) == tuple(want[0].shape),
                   f"{where}: K of shape {tuple(got[0].shape)}, want {tuple(want[0].shape)}")
            expect(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]),
                   f"{where}: the values differ from a cat cache's: did the growth copy the "
                   f"{start} slots already held?")
            expect(not meter.total, f"{where} allocated {meter.total:,} B: hand out views")
    final = reference.nbytes
    most = math.ceil(math.log2((prompt + steps) / prompt)) + 2
    expect(grew <= most, f"{grew} of the {len(writes)} writes allocated: a cache that doubles "
                         f"from {prompt} to {prompt + steps} slots grows about {most - 2} times")
    expect(total <= 4 * final, f"the writes allocated {total:,} B in all, more than 4x the "
                               f"{final:,} B the {prompt + steps} tokens hold: grow by doubling")
    cat_tokens = prompt + sum(prompt + i + 1 for i in range(steps))  # a cat allocates them all
    return (f"grew {grew} times for {prompt + steps} tokens and allocated {total / final:.1f}x "
            f"the final cache in all; a cat cache allocates {cat_tokens / (prompt + steps):.0f}x")
