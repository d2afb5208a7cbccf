"""Exercises of notebook 00 (setup and instruments): checks and reference solutions.

The checks use the shipped configs and the ``meta`` device, so they print the same thing on
every machine.
"""

from __future__ import annotations

from functools import cache

import torch

from kvlib import CatCache
from kvlib.budget import meta_model, plan_budget, weight_bytes
from kvlib.config import GIB, head_dim, load_config

from .checking import attempt, check, expect, hint

# --- 1. the KV bytes of a batch -----------------------------------------------------------


def batch_kv_bytes_solution(config, dtype: torch.dtype, batch: int, context: int) -> int:
    """Every sequence of the batch keeps its own K and V: ``batch * context`` tokens, each
    ``2 * layers * kv_heads * head_dim * bytes`` (only the KV heads are cached)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim(config) * dtype.itemsize
    return batch * context * per_token


@cache
def _transformers_kv_bytes(name: str, dtype: torch.dtype, batch: int, context: int) -> int:
    """Bytes of the cache ``transformers`` returns for ``[batch, context]`` ids, on ``meta``."""
    model = meta_model(name, dtype)
    ids = torch.zeros(batch, context, dtype=torch.long, device="meta")
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    kv = out["cache"] if "cache" in out else out["past_key_values"]  # renamed across versions
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in kv.layers)


BATCH_CASES = [  # (shipped config, dtype, batch, context): the one asked first
    ("qwen3-4b", torch.bfloat16, 4, 64),
    ("smollm2-135m", torch.float32, 3, 17),
    ("qwen2.5-3b", torch.float16, 2, 40),
]


@check
def check_batch_kv_bytes(fn) -> str:
    """``fn(config, dtype, batch, context)`` -> bytes of the K and V ``transformers`` keeps."""
    for name, dtype, batch, context in BATCH_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, batch, context)
        want = _transformers_kv_bytes(name, dtype, batch, context)
        one = want // (batch * context)
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')}, batch {batch} x {context} tokens: "
               f"you said {got}, transformers' cache on the meta device holds {want:,} B.",
               hint(got, {
                   want // batch: "Each sequence of the batch keeps its own K and V.",
                   want // 2: "Did you count K but not V?",
                   one: "That is one token: multiply by the batch and the context.",
                   want * config.num_attention_heads // config.num_key_value_heads:
                       "Only the KV heads are cached (num_key_value_heads), not the query heads.",
               }))
    config = load_config("qwen3-4b")
    room = 12 * GIB - weight_bytes(config, torch.bfloat16)
    each = room // attempt(fn, config, torch.bfloat16, 4, 1)
    planned = plan_budget(config, torch.bfloat16, 12 * GIB, batch=4).max_context
    return (f"so 4 conversations of Qwen3-4B in bf16 share 12 GiB at {each:,} tokens each "
            f"(weights and KV only; with the workspace, plan_budget(..., batch=4) says "
            f"{planned:,})")


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


# --- 3. a cache that refuses writes past a budget -----------------------------------------


class CappedCatCacheSolution(CatCache):
    """A :class:`CatCache` that refuses, with the numbers, a write that would make it hold more
    than ``budget_bytes``; a refused write changes nothing."""

    def __init__(self, n_layers, n_kv_heads, head_dim, budget_bytes):
        super().__init__(n_layers, n_kv_heads, head_dim, device="meta", dtype=torch.bfloat16)
        self.budget_bytes = budget_bytes

    def write(self, layer, start, k, v):
        held = self.k[layer].shape[2]  # the layer's slots now; after the write: start + n
        per_slot = 2 * k[0].numel() * k.element_size()  # one slot of K and V in this layer
        after = self.nbytes + (start + k.shape[0] - held) * per_slot
        if after > self.budget_bytes:
            raise ValueError(f"over budget: layer {layer} writing slots "
                             f"{start}..{start + k.shape[0]} "
                             f"would hold {after:,} B > budget {self.budget_bytes:,} B")
        super().write(layer, start, k, v)


CAP_SHAPE = (4, 2, 8)  # layers, kv_heads, head_dim: 128 B per token per layer in bf16


def _refused(cache, layer, start, n):
    """The exception the learner's ``write`` raised, or ``None`` if it accepted the write."""
    k = torch.empty(n, cache.n_kv_heads, cache.head_dim, dtype=cache.dtype, device=cache.device)
    try:
        attempt(cache.write, layer, start, k, k)
    except ValueError as err:
        return err
    return None


def _held(cache) -> list[int]:
    return [cache.k[layer].shape[2] for layer in range(cache.n_layers)]


@check
def check_capped_cache(cls) -> None:
    """``cls(n_layers, n_kv_heads, head_dim, budget_bytes)``: a CatCache that refuses a write
    which would make it hold more than the budget, before changing anything."""
    layers, heads, dim = CAP_SHAPE
    per_token = 2 * layers * heads * dim * 2  # K and V, bf16
    budget = 20 * per_token  # exactly 20 tokens in every layer
    cache = attempt(cls, layers, heads, dim, budget)
    for t in range(20):  # 20 tokens fill the budget exactly: all accepted
        for layer in range(layers):
            err = _refused(cache, layer, t, 1)
            expect(err is None, f"token {t} (slot {t}) of layer {layer} was refused ({err}), but "
                                f"{t + 1} tokens hold {(t + 1) * per_token:,} B <= budget "
                                f"{budget:,} B: refuse only what passes the budget")
    expect(cache.nbytes == budget, f"after 20 tokens the cache holds {cache.nbytes:,} B, "
                                   f"expected {budget:,} B: write through CatCache.write")
    err = _refused(cache, 0, 20, 1)
    expect(err is not None, f"slot 20 of layer 0 was accepted: the cache now holds "
                            f"{cache.nbytes:,} B > budget {budget:,} B")
    expect(_held(cache) == [20] * layers,
           f"the refused write changed the cache: layers now hold {_held(cache)} slots, "
           f"expected {[20] * layers}: check before writing")
    expect(any(ch.isdigit() for ch in str(err)),
           f"refusing slot 20 of layer 0, your error says {str(err)!r}: name the numbers "
           f"(the bytes it would hold, the budget) in it")
    cache.reset()
    err = _refused(cache, 0, 0, 25)  # a prefill chunk of 25 tokens: layer 0 alone fits
    expect(err is None, f"a 25-token write into layer 0 of an empty cache was refused ({err}): "
                        f"it holds {25 * per_token // layers:,} B <= {budget:,} B")
    for layer in range(1, layers):
        err = _refused(cache, layer, 0, 25)
        over = 25 * per_token // layers * (layer + 1)
        expect((err is None) == (over <= budget),
               f"after the reset, a 25-token write into layer {layer} would make the cache hold "
               f"{over:,} B against a budget of {budget:,} B: it was "
               f"{'refused' if err is not None else 'accepted'}")
