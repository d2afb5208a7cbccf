"""Exercises of notebook 05 (static shapes and CUDA graphs): checks and reference solutions.

The answers are checked against kvlib itself (:class:`kvlib.graphs.StaticStep` and
:class:`kvlib.KVCache` on the ``meta`` device: shapes, no memory), so they print the same thing
on every machine.

Throughout, ``t`` is the number of slots the cache holds before a decode step: the step writes
slot ``t`` and attends over ``t + 1`` slots.
"""

from __future__ import annotations

import torch

from kvlib import KVCache
from kvlib.config import kv_bytes_per_token, load_config
from kvlib.graphs import StaticStep

from .checking import attempt, check, expect

# --- 1. the span a bucketed step reads, and how many graphs -----------------------------

BUCKET_CASES = [  # (max_seq, bucket, t)
    (2048, 256, 0),  # the first step of an empty cache still reads a whole bucket
    (2048, 256, 255),  # writes the last slot of the first bucket
    (2048, 256, 256),  # one slot into the next
    (1000, 256, 990),  # max_seq not a multiple of bucket: the last span is capped
    (30976, 256, 30975),  # the 12 GiB plan's longest context, last step
    (64, 128, 10),  # a bucket bigger than the cache: one graph
]


def bucket_plan_solution(max_seq: int, bucket: int, t: int) -> tuple[int, int]:
    """``(span, n_graphs)``: slots a bucketed step reads with ``t`` held, graphs to capture."""
    span = min(max_seq, (t // bucket + 1) * bucket)  # t + 1 slots rounded up to a bucket, capped
    n_graphs = -(-max_seq // bucket)  # one per bucket: ceil(max_seq / bucket)
    return span, n_graphs


def _static_step(max_seq: int, bucket: int) -> StaticStep:
    cache = KVCache(1, max_seq, 1, 1, device="meta", dtype=torch.float32)
    return StaticStep(None, cache, bucket=bucket, capture=False)  # span() needs no model


def _true_plan(max_seq: int, bucket: int, t: int) -> tuple[int, int]:
    step = _static_step(max_seq, bucket)
    return step.span(t), len({step.span(p) for p in range(max_seq)})


def _pair(got) -> tuple[int, int] | None:
    """``got`` as two ints, or None when it is not a pair of numbers."""
    try:
        first, second = (int(x) for x in got)
    except (TypeError, ValueError):
        return None
    return first, second


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
               f"graphs. Hint: the step reads t + 1 slots, rounded up to a whole bucket, never "
               f"past max_seq; there is one graph per distinct span.")


# --- 2. a conversation's masked reads, and the graphs it captures ------------------------

TRACE_CASES = [  # (config name, dtype, max_seq, bucket, t0, steps)
    ("qwen3-4b", torch.bfloat16, 30976, 256, 1000, 500),  # a 1,000-token prompt, 500 tokens out
    ("qwen3-4b", torch.bfloat16, 30976, 30976, 1000, 500),  # the same with one whole-buffer mask
    ("smollm2-135m", torch.float32, 2048, 64, 0, 2048),  # the whole cache, from empty
    ("llama-3.2-3b", torch.float16, 1000, 256, 990, 10),  # the capped last bucket
]


def trace_waste_solution(config, dtype: torch.dtype, max_seq: int, bucket: int, t0: int,
                         steps: int) -> tuple[int, int]:
    """``(graphs, masked_bytes)`` of the steps at ``t = t0 .. t0 + steps - 1``, in buckets.

    Graphs: one per distinct span the trace reaches (captured the first time it is reached).
    Masked bytes: K and V of the slots each step reads past its ``t + 1``, summed over the steps.
    """
    spans = [min(max_seq, (t // bucket + 1) * bucket) for t in range(t0, t0 + steps)]
    masked = sum(span - (t + 1) for t, span in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * kv_bytes_per_token(config, dtype)


def _true_trace(config, dtype: torch.dtype, max_seq: int, bucket: int, t0: int,
                steps: int) -> tuple[int, int]:
    """StaticStep's spans over the trace; a slot's bytes from the cache's own views."""
    spans = [_static_step(max_seq, bucket).span(t) for t in range(t0, t0 + steps)]
    cache = KVCache.for_model(config, max_seq, device="meta", dtype=dtype)
    slot_bytes = sum(x.nbytes for layer in range(cache.n_layers) for x in cache.view(layer, 1))
    masked = sum(span - (t + 1) for t, span in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * slot_bytes


@check
def check_trace_waste(fn) -> None:
    """``fn(config, dtype, max_seq, bucket, t0, steps)`` -> ``(graphs, masked_bytes)``."""
    for name, dtype, max_seq, bucket, t0, steps in TRACE_CASES:
        answer = attempt(fn, load_config(name), dtype, max_seq, bucket, t0, steps)
        want = _true_trace(load_config(name), dtype, max_seq, bucket, t0, steps)
        got = _pair(answer)
        expect(got is not None, f"return a pair (graphs, masked_bytes), not {answer!r}")
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')}, max_seq={max_seq}, "
               f"bucket={bucket}, t={t0}..{t0 + steps - 1}: you said {got[0]} graphs and "
               f"{got[1]:,} B masked; StaticStep captures {want[0]} graphs on this trace and "
               f"reads {want[1]:,} B of masked K and V. Hint: count only the spans the trace "
               f"reaches; a step with t held needs t + 1 slots, the rest of its span is masked.")
