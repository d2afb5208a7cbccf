"""Exercises of notebook 02 (the ``cat`` cache): checks and reference solutions.

The answers are checked against the meter counting a real :class:`kvlib.CatCache` on the
``meta`` device (shapes, no memory), so the checks print the same thing on every machine and
take no time.
"""

from __future__ import annotations

import torch

from kvlib import CatCache
from kvlib.config import head_dim, load_config
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect

# (shipped config, dtype, prompt tokens p, decode steps n)
CASES = [
    ("smollm2-135m", torch.float32, 100, 50),
    ("qwen3-4b", torch.bfloat16, 1000, 40),
    ("llama-3.2-3b", torch.float16, 7, 13),
]


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


# --- 2. all the steps: the closed form ---------------------------------------------------


def cumulative_bytes_solution(config, dtype: torch.dtype, prompt: int, steps: int) -> int:
    """Bytes allocated (and copied) by ``steps`` decode steps after a ``prompt``-token prefill.

    Step ``i`` holds ``prompt + i + 1`` slots afterwards, so the total is
    ``per_token * sum_{i=0}^{n-1} (p + i + 1) = per_token * (n*p + n*(n+1)/2)``:
    linear in the prompt, quadratic in the number of steps.
    """
    element = torch.empty((), dtype=dtype).element_size()
    kv_heads, layers = config.num_key_value_heads, config.num_hidden_layers
    per_token = 2 * layers * kv_heads * head_dim(config) * element
    return per_token * (steps * prompt + steps * (steps + 1) // 2)


@check
def check_cumulative_bytes(fn) -> None:
    """``fn(config, dtype, prompt, steps)`` -> bytes the cat cache allocates over the steps."""
    for name, dtype, prompt, steps in CASES:
        config = load_config(name)
        got = int(attempt(fn, config, dtype, prompt, steps))
        want = sum(_metered_steps(config, dtype, prompt, steps))
        expect(got == want,
               f"{name} in {_short(dtype)}, prompt p={prompt}, n={steps} steps: you predicted "
               f"{got:,} B, the meter counted {want:,} B in total. Hint: step i leaves "
               f"p+i+1 slots, for i = 0 .. n-1; sum them and multiply by the bytes per token.")
