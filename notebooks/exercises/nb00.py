"""Exercises of notebook 00 (setup and instruments): checks and reference solutions.

Each ``check_*`` prints exactly ``not attempted yet`` when the learner's function
still raises ``NotImplementedError``, ``correct`` when it is right, and otherwise a
message naming the numbers that differ. The checks use the shipped configs and the
``meta`` device, so they print the same thing on every machine.
"""

from __future__ import annotations

import torch

from kvlib import CatCache
from kvlib.config import GIB, head_dim, load_config, shipped_configs
from kvlib.budget import plan_budget
from kvlib.meter import AllocMeter

NOT_ATTEMPTED = "not attempted yet"


# --- 1. KV bytes per token, from the config ----------------------------------------------


def kv_bytes_per_token_solution(config, bytes_per_element: int) -> int:
    """K and V (2) for every layer, every KV head (not query head), head_dim elements each."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim(config) * bytes_per_element


def check_kv_bytes_per_token(fn) -> None:
    """``fn(config, bytes_per_element)`` -> bytes of K and V for one token, all layers."""
    for name in shipped_configs():
        config = load_config(name)
        for element in (2, 4, 1):
            try:
                got = fn(config, element)
            except NotImplementedError:
                print(NOT_ATTEMPTED)
                return
            want = kv_bytes_per_token_solution(config, element)
            if got != want:
                hint = ""
                if got == want // 2:
                    hint = " Did you count K but not V?"
                elif got == want * config.num_attention_heads // config.num_key_value_heads:
                    hint = " Only the KV heads are cached (num_key_value_heads), not the query heads."
                print(
                    f"{name} at {element} bytes/element: you returned {got}, expected {want} "
                    f"(layers={config.num_hidden_layers}, kv_heads={config.num_key_value_heads}, "
                    f"head_dim={head_dim(config)}).{hint}"
                )
                return
    print("correct")


# --- 2. Llama-3.2-3B on a Colab T4 -------------------------------------------------------

T4_BUDGET = 15 * GIB  # what the exercise plans against (Colab's T4 shows about 15 GiB)


def llama_on_t4_solution() -> int:
    """A T4 (capability 7.5) runs fp16: 2 bytes, like bf16, so the answer is bf16's."""
    return plan_budget(load_config("llama-3.2-3b"), torch.float16, T4_BUDGET).max_context


def check_llama_on_t4(fn) -> None:
    """``fn()`` -> the longest context of Llama-3.2-3B that fits 15 GiB on a T4."""
    try:
        got = fn()
    except NotImplementedError:
        print(NOT_ATTEMPTED)
        return
    want = llama_on_t4_solution()
    if got == want:
        print("correct")
        return
    config = load_config("llama-3.2-3b")
    known = {
        plan_budget(config, torch.float32, T4_BUDGET).max_context:
            "that is the fp32 answer: a T4 runs fp16, 2 bytes per element",
        plan_budget(config, torch.float16, 16 * GIB).max_context:
            "that is for 16 GiB: plan with T4_BUDGET = 15 GiB",
        plan_budget(config, torch.float16, 12 * GIB).max_context:
            "that is for 12 GiB: plan with T4_BUDGET = 15 GiB",
    }
    hint = known.get(got, "use plan_budget(config, dtype, T4_BUDGET).max_context")
    print(f"you returned {got}, expected {want}: {hint}.")


# --- 3. what one cat step allocates ------------------------------------------------------


def cat_step_bytes_solution(config, t: int, bytes_per_element: int) -> int:
    """A cat from t to t+1 tokens allocates the whole new tensor, t+1 tokens, every layer, K and V."""
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


def check_cat_step_bytes(fn) -> None:
    """``fn(config, t, bytes_per_element)`` -> bytes one cat step allocates at length t."""
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        for t, element in ((0, 2), (100, 2), (4096, 2), (1000, 4)):
            try:
                got = fn(config, t, element)
            except NotImplementedError:
                print(NOT_ATTEMPTED)
                return
            want = _metered_cat_step(config, t, element)
            if got != want:
                per_token = kv_bytes_per_token_solution(config, element)
                hint = ""
                if got == per_token:
                    hint = " A cat does not allocate only the new token: it makes a new tensor for all of them."
                elif got == t * per_token:
                    hint = " The new tensor holds the t old tokens *and* the new one."
                print(
                    f"{name}, t={t}, {element} bytes/element: you predicted {got}, "
                    f"the meter counted {want}.{hint}"
                )
                return
    print("correct")
