"""Exercises of notebook 05 (static shapes and CUDA graphs): checks and reference solutions.

The answers are checked against kvlib itself (:class:`kvlib.graphs.StaticStep` and
:class:`kvlib.KVCache` on the ``meta`` device: shapes, no memory), so they print the same thing
on every machine.

Throughout, ``t`` is the number of tokens in the cache at a decode step, the one
being decoded included: the step runs at position ``t - 1`` and must see ``t`` slots.
"""

from __future__ import annotations

import torch

from kvlib import KVCache
from kvlib.config import kv_bytes_per_token, load_config
from kvlib.graphs import StaticStep

from .checking import attempt, check, expect

# --- 1. the span a bucketed step reads, and how many graphs -----------------------------

BUCKET_CASES = [  # (max_seq, bucket, t)
    (2048, 256, 1),  # the first step of an empty cache still reads a whole bucket
    (2048, 256, 256),  # exactly full bucket
    (2048, 256, 257),  # one slot into the next
    (1000, 256, 990),  # max_seq not a multiple of bucket: the last span is capped
    (32620, 256, 32620),  # the 12 GiB budget's longest context, last step
    (64, 128, 10),  # a bucket bigger than the cache: one graph
]


def bucket_plan_solution(max_seq: int, bucket: int, t: int) -> tuple[int, int]:
    """``(span, n_graphs)``: slots a bucketed step reads at ``t`` tokens, graphs to capture."""
    span = min(max_seq, -(-t // bucket) * bucket)  # t rounded up to a whole bucket, capped
    n_graphs = -(-max_seq // bucket)  # one per bucket: ceil(max_seq / bucket)
    return span, n_graphs


def _true_plan(max_seq: int, bucket: int, t: int) -> tuple[int, int]:
    cache = KVCache(1, max_seq, 1, 1, device="meta", dtype=torch.float32)
    step = StaticStep(None, cache, bucket=bucket, capture=False)  # span() needs no model
    return step.span(t - 1), len({step.span(p) for p in range(max_seq)})


def _pair(got) -> tuple[int, int] | None:
    """``got`` as two ints, or None when it is not a pair of numbers."""
    try:
        span, n_graphs = (int(x) for x in got)
    except (TypeError, ValueError):
        return None
    return span, n_graphs


@check
def check_bucket_plan(fn) -> None:
    """``fn(max_seq, bucket, t)`` -> ``(span, n_graphs)``, as kvlib's StaticStep does it."""
    for max_seq, bucket, t in BUCKET_CASES:
        answer = attempt(fn, max_seq, bucket, t)
        want = _true_plan(max_seq, bucket, t)
        got = _pair(answer)
        expect(got is not None, f"return a pair (span, n_graphs), not {answer!r}")
        expect(got == want,
               f"max_seq={max_seq}, bucket={bucket}, t={t}: you said span {got[0]}, "
               f"{got[1]} graphs; StaticStep reads {want[0]} slots and captures {want[1]} "
               f"graphs. Hint: the span is t rounded up to a whole bucket, never past max_seq; "
               f"there is one graph per distinct span.")


# --- 2. what the whole-buffer mask reads for nothing ------------------------------------

MASK_CASES = [  # (config name, dtype, max_seq, t)
    ("qwen3-4b", torch.bfloat16, 32620, 1024),
    ("smollm2-135m", torch.float32, 2048, 43),
    ("llama-3.2-3b", torch.float16, 8192, 8192),  # a full cache wastes nothing
    ("qwen2.5-3b", torch.bfloat16, 4096, 1),
]


def mask_extra_bytes_solution(config, dtype: torch.dtype, max_seq: int, t: int) -> int:
    """Bytes of K and V a whole-buffer masked step reads beyond the ``t`` slots it needs."""
    return (max_seq - t) * kv_bytes_per_token(config, dtype)


def _true_extra(config, dtype: torch.dtype, max_seq: int, t: int) -> int:
    """Bytes of the whole-buffer views minus the sliced views, all layers, K and V."""
    cache = KVCache.for_model(config, max_seq, device="meta", dtype=dtype)
    extra = 0
    for layer in range(cache.n_layers):
        for whole, sliced in zip(cache.view(layer, max_seq), cache.view(layer, t)):
            extra += whole.nbytes - sliced.nbytes
    return extra


@check
def check_mask_extra_bytes(fn) -> None:
    """``fn(config, dtype, max_seq, t)`` -> extra bytes read attending over the whole buffer."""
    for name, dtype, max_seq, t in MASK_CASES:
        config = load_config(name)
        got = int(attempt(fn, config, dtype, max_seq, t))
        want = _true_extra(config, dtype, max_seq, t)
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')}, max_seq={max_seq}, t={t}: you "
               f"said {got:,} B, the cache's views differ by {want:,} B "
               f"({max_seq - t} masked slots; K and V, {config.num_hidden_layers} layers, "
               f"{config.num_key_value_heads} KV heads).")
