"""Exercises of notebook 02 (the ``cat`` cache): checks and reference solutions.

The answers are checked with the meter against a real :class:`kvlib.CatCache`, on the ``meta``
device (shapes, no memory) or on small CPU tensors, so the checks print the same thing on every
machine and take no time.
"""

from __future__ import annotations

import math

import torch

from kvlib import CatCache
from kvlib.config import head_dim, load_config
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _metered_steps(config, dtype: torch.dtype, prompt: int, steps: int) -> list[int]:
    """Bytes a CatCache allocates in each of ``steps`` one-token writes after ``prompt`` tokens."""
    cache = CatCache.for_model(config, device="meta", dtype=dtype)
    hkv, d = config.num_key_value_heads, head_dim(config)
    k = torch.empty(prompt, hkv, d, dtype=dtype, device="meta")  # [p, Hkv, D]
    one = torch.empty(1, hkv, d, dtype=dtype, device="meta")  # [1, Hkv, D]
    for layer in range(cache.n_layers):  # the prefill: not counted
        cache.write(layer, 0, k, k)
    with AllocMeter() as meter:
        for i in range(steps):  # decode step i writes slot prompt + i in every layer
            for layer in range(cache.n_layers):
                cache.write(layer, prompt + i, one, one)
            meter.mark()
    return meter.steps


# --- 1. one step -----------------------------------------------------------------------


def step_bytes_solution(config, dtype: torch.dtype, t: int) -> int:
    """Bytes one decode step allocates (and copies) when the cache already holds ``t`` tokens.

    Every layer makes new K and V of ``t + 1`` slots:
    ``2 * layers * (t+1) * kv_heads * head_dim * elt``.
    """
    element = torch.empty((), dtype=dtype).element_size()
    kv_heads, layers = config.num_key_value_heads, config.num_hidden_layers
    return 2 * layers * (t + 1) * kv_heads * head_dim(config) * element


def first_slot_over_solution(config, dtype: torch.dtype, limit_bytes: int) -> int:
    """The smallest ``t`` whose step (writing slot ``t``) allocates more than ``limit_bytes``.

    The step allocates ``per_token * (t + 1)``, so we need ``t + 1 > limit / per_token``:
    ``t + 1 = limit // per_token + 1``, i.e. ``t = limit // per_token``.
    """
    per_token = step_bytes_solution(config, dtype, 0)
    return limit_bytes // per_token


LIMIT_CASES = [  # (shipped config, dtype, limit in bytes)
    ("qwen3-4b", torch.bfloat16, 2**30),
    ("smollm2-135m", torch.float32, 100 * 2**20),
    ("llama-3.2-3b", torch.float16, 123_456_789),
    # exactly three tokens of KV (the step writing slot 2): that step is not "more", slot 3's is
    ("qwen3-4b", torch.bfloat16, step_bytes_solution(load_config("qwen3-4b"), torch.bfloat16, 2)),
]


@check
def check_first_slot_over(fn) -> None:
    """``fn(config, dtype, limit)`` -> the first slot whose cat step allocates over ``limit`` B."""
    for name, dtype, limit in LIMIT_CASES:
        config = load_config(name)
        got = int(attempt(fn, config, dtype, limit))
        where = f"{name} in {_short(dtype)}, limit {limit:,} B"
        expect(got >= 0, f"{where}: t={got} is not a slot")
        at = _metered_steps(config, dtype, got, 1)[0]
        expect(at > limit, f"{where}: the step writing slot t={got:,} allocates {at:,} B "
                           f"(metered), not more than the limit: t is too small")
        if got > 0:
            before = _metered_steps(config, dtype, got - 1, 1)[0]
            expect(before <= limit, f"{where}: the step writing slot t-1={got - 1:,} already "
                                    f"allocates {before:,} B (metered), more than the limit: "
                                    f"find the smallest t")


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
