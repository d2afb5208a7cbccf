"""Exercises of notebook 00 (setup and instruments): checks and reference solutions.

The checks use the shipped configs and the ``meta`` device, so they print the same thing on
every machine.
"""

from __future__ import annotations

import sys
from functools import cache

import torch

from kvlib import CatCache
from kvlib import budget as kv_budget
from kvlib import config as kv_config
from kvlib import contract as kv_contract
from kvlib.budget import meta_model, plan_budget, weight_bytes
from kvlib.config import GIB, head_dim, load_config

from .checking import attempt, check, expect, hint

# What each exercise builds, hidden from the learner's function while a check calls it.
# The reference solutions are hidden too: the notebook imports this module.
_HERE = sys.modules[__name__]
PLAN = ((kv_budget, "plan_budget"), (kv_budget, "Budget"))
KV_BYTES = PLAN + ((kv_config, "kv_bytes_per_token"), (kv_config, "kv_token_bytes"),
                   (kv_config, "kv_bytes"), (kv_budget, "kv_bytes"),
                   (kv_budget, "kv_bytes_per_token"), (kv_contract, "kv_token_bytes"),
                   (kv_contract, "bytes_per_token"), (_HERE, "batch_kv_bytes_solution"))
EXTRA = PLAN + ((_HERE, "extra_tokens_on_t4_solution"), (_HERE, "llama_on_t4"))


def hint_near(got, known: dict, share: float = 0.01) -> str:
    """The hint of the first known wrong answer within ``share`` of ``got`` (`` text``, or "").

    ``checking.hint`` matches a wrong answer exactly. A prediction made by arithmetic lands near
    a wrong answer, not on it (a rounding, a whole chunk), so exercise 2 needs this tolerant twin.
    """
    return next((f" {text}" for wrong, text in known.items()
                 if abs(got - wrong) <= share * wrong), "")


# --- 1. the KV bytes of a padded batch ----------------------------------------------------


def batch_kv_bytes_solution(config, dtype: torch.dtype, lengths) -> int:
    """A batch is one ``[batch, longest]`` tensor of ids: shorter prompts are padded to the
    longest, and every sequence keeps K and V for every position, padding included. Each position
    costs ``2 * layers * kv_heads * head_dim * bytes`` (only the KV heads are cached)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim(config) * dtype.itemsize
    return len(lengths) * max(lengths) * per_token


@cache
def _transformers_kv_bytes(name: str, dtype: torch.dtype, lengths: tuple) -> int:
    """Bytes of the cache ``transformers`` returns for the padded batch of ``lengths``, on
    ``meta``: ids ``[batch, longest]``; which positions are padding does not change the size."""
    model = meta_model(name, dtype)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device="meta")
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    kv = out["cache"] if "cache" in out else out["past_key_values"]  # renamed across versions
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in kv.layers)


BATCH_CASES = [  # (shipped config, dtype, prompt lengths): the one asked first
    ("qwen3-4b", torch.bfloat16, (64, 16, 48, 8)),
    ("smollm2-135m", torch.float32, (17, 17, 17)),
    ("qwen2.5-3b", torch.float16, (40, 1)),
]


@check
def check_batch_kv_bytes(fn) -> str:
    """``fn(config, dtype, lengths)`` -> bytes of the K and V ``transformers`` keeps for the
    padded batch of prompts of these lengths."""
    for name, dtype, lengths in BATCH_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, list(lengths), hide=KV_BYTES)
        want = _transformers_kv_bytes(name, dtype, lengths)
        batch = len(lengths)
        one = want // (batch * max(lengths))
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')}, prompts of {list(lengths)} tokens: "
               f"you said {got}, transformers' cache on the meta device holds {want:,} B.",
               hint(got, {
                   sum(lengths) * one: "A batch's ids are one [batch, longest] tensor: every "
                                       "prompt is padded to the longest, and the cache keeps K "
                                       "and V for the padding too.",
                   want // batch: "Each sequence of the batch keeps its own K and V.",
                   want // 2: "Did you count K but not V?",
                   one: "That is one token: multiply by the batch and the longest prompt.",
                   want * config.num_attention_heads // config.num_key_value_heads:
                       "Only the KV heads are cached (num_key_value_heads), not the query heads.",
               }))
    name, _, lengths = BATCH_CASES[0]
    real, slots = sum(lengths), len(lengths) * max(lengths)
    config = load_config(name)
    room = 12 * GIB - weight_bytes(config, torch.bfloat16)
    each = room // attempt(fn, config, torch.bfloat16, [1] * 4, hide=KV_BYTES)
    planned = plan_budget(config, torch.bfloat16, 12 * GIB, batch=4).max_context
    return (f"prompts of {list(lengths)}: {slots} positions cached for {real} real tokens, so "
            f"{1 - real / slots:.0%} of the cache is padding. On 12 GiB, 4 conversations of "
            f"Qwen3-4B get {each:,} positions each (weights and KV only; with the workspace, "
            f"plan_budget(..., batch=4) says {planned:,})")


# --- 2. three more GiB on a Colab T4 ------------------------------------------------------

T4_BUDGET = 15 * GIB  # what the exercise plans against (Colab's T4 shows about 15 GiB)


def extra_tokens_on_t4_solution() -> int:
    """A T4 runs fp16: 2 bytes, like bf16. Each more token of context costs its K and V in every
    layer and its id (int64, 8 bytes), which the loop keeps on the device; the rest of the
    workspace does not grow with the context (section 6)."""
    config = load_config("llama-3.2-3b")
    e = torch.float16.itemsize
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * e
    return (T4_BUDGET - 12 * GIB) // (kv + 8)


def llama_on_t4() -> int:
    """plan_budget's longest context of Llama-3.2-3B on a T4 (fp16, 15 GiB)."""
    return plan_budget(load_config("llama-3.2-3b"), torch.float16, T4_BUDGET).max_context


@check
def check_extra_tokens_on_t4(fn) -> str:
    """``fn()`` -> how many more tokens of Llama-3.2-3B fit 15 GiB than 12, by arithmetic."""
    got = attempt(fn, hide=EXTRA)
    config = load_config("llama-3.2-3b")
    at12 = plan_budget(config, torch.float16, 12 * GIB).max_context
    at15 = llama_on_t4()
    want = at15 - at12
    expect(isinstance(got, int | float) and not isinstance(got, bool),
           f"you returned {got!r}: return a number of tokens (plan_budget says {want:,}).")
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) \
        * torch.float16.itemsize  # the wrong answers below
    expect(abs(got - want) <= want / 100,
           f"you predicted {got:,} more tokens; plan_budget says {want:,} ({at12:,} on 12 GiB, "
           f"{at15:,} on 15 GiB); within 1% counts as right.",
           hint_near(got, {
               3 * GIB // (2 * kv + 8): "That is fp32: a T4 runs fp16, 2 bytes per element.",
               3 * GIB // (kv // 2 + 8): "Did you count K but not V?",
               3 * 10**9 // (kv + 8): "3 GiB are 3 x 2^30 bytes, not 3 x 10^9.",
               4 * GIB // (kv + 8): "That is for 4 more GiB: the T4 offers 15 GiB.",
               at15: "That is the whole context on 15 GiB: how many MORE than on 12 GiB?",
           }))
    return (f"plan_budget: {at12:,} tokens on 12 GiB, {at15:,} on the T4's 15 GiB, "
            f"+{want:,}; your arithmetic: +{got:,} (fp16 and bf16 cost the same bytes)")


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
