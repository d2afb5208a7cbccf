"""Exercises of notebook 05 (static shapes and CUDA graphs): checks and reference solutions.

The answers are checked against kvlib itself (:func:`kvlib.graphs.span`, the rule
:class:`kvlib.graphs.StaticStep` reads by, and :class:`kvlib.KVCache` on the ``meta`` device:
shapes, no memory), so they print the same thing on every machine.

Throughout, ``t`` is the number of slots the cache holds before a decode step: the step writes
slot ``t`` and attends over ``t + 1`` slots.
"""

from __future__ import annotations

import sys

import torch

from kvlib import KVCache, graphs
from kvlib.config import GIB, MIB, kv_bytes_per_token, load_config

from .checking import attempt, check, expect

# What each exercise builds, hidden from the learner's function while a check calls it. The
# reference solutions are hidden too: the notebook imports this module.
_HERE = sys.modules[__name__]
PICK = ((graphs, "span"), (_HERE, "pick_bucket_solution"))
TRACE = ((graphs, "span"), (_HERE, "trace_waste_solution"))

# --- 1. the smallest bucket within a graph limit, and what it reads masked ----------------

PICK_CASES = [  # (config name, dtype, max_seq, max_graphs, max_masked_bytes)
    ("qwen3-4b", torch.bfloat16, 32579, 128, 64 * MIB),  # a cache near the 12 GiB plan: fits
    ("qwen3-4b", torch.bfloat16, 32579, 8, 64 * MIB),  # too few graphs for 64 MiB: None
    ("qwen3-4b", torch.bfloat16, 32579, 1, 8 * GIB),  # one graph: the whole-buffer mask
    ("smollm2-135m", torch.float32, 1000, 3, 64 * MIB),  # 1000 / 3 is not whole: round up
    ("llama-3.2-3b", torch.float16, 1024, 4, 255 * 114688),  # exactly at the limit: it fits
    ("smollm2-135m", torch.float32, 64, 100, 0),  # more graphs than slots: buckets of 1
]


def pick_bucket_solution(config, dtype: torch.dtype, max_seq: int, max_graphs: int,
                         max_masked_bytes: int) -> tuple[int, int] | None:
    """``(bucket, masked_bytes)``: the smallest bucket with at most ``max_graphs`` graphs, and the
    most masked K/V bytes one of its steps reads; None when that is over ``max_masked_bytes``.

    The smallest bucket, because a bigger one only reads more masked slots. The worst step is the
    first of a bucket: it reads the whole bucket for one slot held, ``bucket - 1`` slots masked.
    """
    bucket = -(-max_seq // max_graphs)  # ceil: ceil(max_seq / bucket) <= max_graphs from here on
    masked = (min(bucket, max_seq) - 1) * kv_bytes_per_token(config, dtype)
    return (bucket, masked) if masked <= max_masked_bytes else None


def _graphs_and_worst(max_seq: int, bucket: int) -> tuple[int, int]:
    """StaticStep's count: distinct spans over the cache, and the most masked slots of a step."""
    spans = [graphs.span(t, bucket, max_seq) for t in range(max_seq)]
    return len(set(spans)), max(s - t - 1 for t, s in enumerate(spans))


def _slot_bytes(config, dtype: torch.dtype) -> int:
    """One slot's K and V over all layers, from the cache's own views (not the formula)."""
    cache = KVCache.for_model(config, 1, device="meta", dtype=dtype)
    return sum(x.nbytes for layer in range(cache.n_layers) for x in cache.view(layer, 1))


def _pair(got) -> tuple[int, int] | None:
    """``got`` as two ints, or None when it is not a pair of numbers."""
    try:
        first, second = (int(x) for x in got)
    except (TypeError, ValueError):
        return None
    return first, second


@check
def check_pick_bucket(fn) -> None:
    """``fn(config, dtype, max_seq, max_graphs, max_masked_bytes)`` -> ``(bucket, bytes)``/None."""
    for name, dtype, max_seq, max_graphs, limit in PICK_CASES:
        config = load_config(name)
        answer = attempt(fn, config, dtype, max_seq, max_graphs, limit, hide=PICK)
        case = (f"{name} in {str(dtype).removeprefix('torch.')}, max_seq={max_seq}, "
                f"max_graphs={max_graphs}, max_masked_bytes={limit:,}")
        want_bucket = -(-max_seq // max_graphs)
        graphs, worst = _graphs_and_worst(max_seq, want_bucket)
        below = _graphs_and_worst(max_seq, want_bucket - 1)[0] if want_bucket > 1 else None
        # The formula's bucket, confirmed by kvlib: it fits the graphs, one slot less does not.
        assert graphs <= max_graphs and (below is None or below > max_graphs), (graphs, below)
        want_bytes = worst * _slot_bytes(config, dtype)
        fits = want_bytes <= limit
        got = _pair(answer)
        expect(answer is None or got is not None,
               f"{case}: return a pair (bucket, masked_bytes) or None, not {answer!r}")
        if not fits:
            expect(answer is None,
                   f"{case}: you returned {answer!r}, but no bucket meets both limits: the "
                   f"smallest with at most {max_graphs} graphs is {want_bucket}, and its worst "
                   f"step reads {want_bytes:,} B of masked K and V, over the limit.")
            continue
        expect(answer is not None,
               f"{case}: you returned None, but bucket {want_bucket} needs {graphs} graphs and "
               f"its worst step reads {want_bytes:,} B of masked K and V, within the limit.")
        bucket, masked = got
        expect(bucket > 0, f"{case}: bucket {bucket} holds no slot; a bucket holds at least 1.")
        if bucket < want_bucket:
            n = _graphs_and_worst(max_seq, bucket)[0]
            expect(False, f"{case}: bucket {bucket} needs {n} graphs to cover {max_seq} slots, "
                          f"more than {max_graphs}. Hint: round max_seq / max_graphs up, not down.")
        expect(bucket == want_bucket,
               f"{case}: bucket {bucket} keeps to {max_graphs} graphs, but the smaller bucket "
               f"{want_bucket} does too ({graphs} graphs) and reads fewer masked slots: take the "
               f"smallest.")
        expect(masked == want_bytes,
               f"{case}: bucket {bucket}: you said {masked:,} B masked; its worst step reads "
               f"{worst} masked slots, {want_bytes:,} B of K and V. Hint: a step masks the slots "
               f"of its span past its t + 1; a bucket's first step masks the most.")


# --- 2. a conversation's masked reads, and the graphs it captures ------------------------

TRACE_CASES = [  # (config name, dtype, max_seq, bucket, t0, steps)
    ("qwen3-4b", torch.bfloat16, 32579, 256, 1000, 500),  # a 1,000-token prompt, 500 tokens out
    ("qwen3-4b", torch.bfloat16, 32579, 32579, 1000, 500),  # the same with one whole-buffer mask
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
    spans = [graphs.span(t, bucket, max_seq) for t in range(t0, t0 + steps)]
    cache = KVCache.for_model(config, max_seq, device="meta", dtype=dtype)
    slot_bytes = sum(x.nbytes for layer in range(cache.n_layers) for x in cache.view(layer, 1))
    masked = sum(span - (t + 1) for t, span in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * slot_bytes


@check
def check_trace_waste(fn) -> None:
    """``fn(config, dtype, max_seq, bucket, t0, steps)`` -> ``(graphs, masked_bytes)``."""
    for name, dtype, max_seq, bucket, t0, steps in TRACE_CASES:
        answer = attempt(fn, load_config(name), dtype, max_seq, bucket, t0, steps, hide=TRACE)
        want = _true_trace(load_config(name), dtype, max_seq, bucket, t0, steps)
        got = _pair(answer)
        expect(got is not None, f"return a pair (graphs, masked_bytes), not {answer!r}")
        expect(got == want,
               f"{name} in {str(dtype).removeprefix('torch.')}, max_seq={max_seq}, "
               f"bucket={bucket}, t={t0}..{t0 + steps - 1}: you said {got[0]} graphs and "
               f"{got[1]:,} B masked; StaticStep captures {want[0]} graphs on this trace and "
               f"reads {want[1]:,} B of masked K and V. Hint: count only the spans the trace "
               f"reaches; a step with t held needs t + 1 slots, the rest of its span is masked.")
    pairs = {b: _true_trace(load_config("qwen3-4b"), torch.bfloat16, 32579, b, 1000, 500)
             for b in (64, 1024)}
    return "your prediction, on a 1,000-token prompt and 500 tokens out: " + "; ".join(
        f"buckets of {b:,}: {g} graphs, {m / MIB:,.0f} MiB masked" for b, (g, m) in pairs.items())
