"""Exercises of notebook 00 (setup and instruments): checks and reference solutions.

The checks use the shipped configs and the ``meta`` device, so they print the same thing on
every machine.
"""

from __future__ import annotations

import torch

from kvlib import CatCache
from kvlib.config import GIB, head_dim, load_config, shipped_configs
from kvlib.budget import plan_budget
from kvlib.meter import AllocMeter

from .checking import attempt, check, expect, hint

# --- 1. KV bytes per token, from the config ----------------------------------------------


def kv_bytes_per_token_solution(config, bytes_per_element: int) -> int:
    """K and V (2) for every layer, every KV head (not query head), head_dim elements each."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim(config) * bytes_per_element


@check
def check_kv_bytes_per_token(fn) -> None:
    """``fn(config, bytes_per_element)`` -> bytes of K and V for one token, all layers."""
    for name in shipped_configs():
        config = load_config(name)
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        for element in (2, 4, 1):
            got = attempt(fn, config, element)
            want = kv_bytes_per_token_solution(config, element)
            expect(got == want,
                   f"{name} at {element} bytes/element: you returned {got}, expected {want} "
                   f"(layers={config.num_hidden_layers}, kv_heads={hkv}, "
                   f"head_dim={head_dim(config)}).",
                   hint(got, {
                       want // 2: "Did you count K but not V?",
                       want * hq // hkv: "Only the KV heads are cached (num_key_value_heads), "
                                         "not the query heads.",
                   }))


# --- 2. Llama-3.2-3B on a Colab T4 -------------------------------------------------------

T4_BUDGET = 15 * GIB  # what the exercise plans against (Colab's T4 shows about 15 GiB)


def llama_on_t4_solution() -> int:
    """A T4 (capability 7.5) runs fp16: 2 bytes, like bf16, so the answer is bf16's."""
    return plan_budget(load_config("llama-3.2-3b"), torch.float16, T4_BUDGET).max_context


@check
def check_llama_on_t4(fn) -> None:
    """``fn()`` -> the longest context of Llama-3.2-3B that fits 15 GiB on a T4."""
    got = attempt(fn)
    want = llama_on_t4_solution()
    config = load_config("llama-3.2-3b")
    expect(got == want, f"you returned {got}, expected {want}:", hint(got, {
        plan_budget(config, torch.float32, T4_BUDGET).max_context:
            "that is the fp32 answer: a T4 runs fp16, 2 bytes per element.",
        plan_budget(config, torch.float16, 16 * GIB).max_context:
            "that is for 16 GiB: plan with T4_BUDGET = 15 GiB.",
        plan_budget(config, torch.float16, 12 * GIB).max_context:
            "that is for 12 GiB: plan with T4_BUDGET = 15 GiB.",
    }, default="use plan_budget(config, dtype, T4_BUDGET).max_context."))


# --- 3. what one cat step allocates ------------------------------------------------------


def cat_step_bytes_solution(config, t: int, bytes_per_element: int) -> int:
    """A cat from t to t+1 tokens allocates the whole new tensor: t+1 tokens, every layer, K, V."""
    return (t + 1) * kv_bytes_per_token_solution(config, bytes_per_element)


_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}


def _metered_cat_step(config, t: int, bytes_per_element: int) -> int:
    """Bytes the meter sees when a meta ``CatCache`` holding t tokens takes one more."""
    dtype = _DTYPES[bytes_per_element]
    cache = CatCache.for_model(config, device="meta", dtype=dtype)
    shape = (cache.n_kv_heads, cache.head_dim)
    if t:
        old = torch.empty(t, *shape, dtype=dtype, device="meta")
        for layer in range(cache.n_layers):
            cache.write(layer, 0, old, old)
    new = torch.empty(1, *shape, dtype=dtype, device="meta")
    with AllocMeter() as meter:
        for layer in range(cache.n_layers):
            cache.write(layer, t, new, new)
    return meter.total


@check
def check_cat_step_bytes(fn) -> None:
    """``fn(config, t, bytes_per_element)`` -> bytes one cat step allocates at length t."""
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        for t, element in ((0, 2), (100, 2), (4096, 2), (1000, 4)):
            got = attempt(fn, config, t, element)
            want = _metered_cat_step(config, t, element)
            per_token = kv_bytes_per_token_solution(config, element)
            expect(got == want,
                   f"{name}, t={t}, {element} bytes/element: you predicted {got}, "
                   f"the meter counted {want}.",
                   hint(got, {
                       per_token: "A cat does not allocate only the new token: it makes a new "
                                  "tensor for all of them.",
                       t * per_token: "The new tensor holds the t old tokens *and* the new one.",
                   }))
