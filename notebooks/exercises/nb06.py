"""Exercises of notebook 06 (capstone: a 12 GB card): checks and reference solutions.

Everything is arithmetic on shipped configs, so the checks print the same thing on every
machine.
"""

from __future__ import annotations

import torch

from kvlib.bandwidth import decode_bytes
from kvlib.budget import plan_budget, weight_bytes, workspace_bytes
from kvlib.config import GIB, kv_bytes_per_token, load_config

from .checking import attempt, check, expect

PREFILL_CHUNK = 512


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- 1. the longest context on a bigger card ---------------------------------------------


def longest_context_solution(config, dtype: torch.dtype, batch: int, budget_bytes: int) -> int:
    """Tokens per sequence that fit: (budget - weights - workspace) // (KV bytes/token x batch)."""
    weights = weight_bytes(config, dtype)
    workspace = workspace_bytes(config, dtype, tokens=PREFILL_CHUNK, batch=batch)
    per_token = kv_bytes_per_token(config, dtype, batch)  # all `batch` sequences grow together
    return max(0, (budget_bytes - weights - workspace) // per_token)


LONGEST_CASES = [  # (config, dtype, batch, budget GiB): the asked one first
    ("llama-3.2-3b", torch.float16, 4, 24),
    ("qwen3-4b", torch.bfloat16, 1, 12),
    ("qwen2.5-3b", torch.float32, 2, 16),
    ("smollm2-135m", torch.float32, 8, 4),
]


@check
def check_longest_context(fn) -> None:
    """``fn(config, dtype, batch, budget_bytes)`` -> the longest context, as ``plan_budget``."""
    for name, dtype, batch, gib in LONGEST_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, batch, gib * GIB)
        plan = plan_budget(config, dtype, gib * GIB, batch=batch, prefill_chunk=PREFILL_CHUNK)
        expect(got is not None and int(got) == plan.max_context,
               f"{name} in {_name(dtype)}, batch {batch}, {gib} GiB: you said {got}, the plan "
               f"says {plan.max_context:,} tokens per sequence (weights {plan.weights:,} B, "
               f"workspace {plan.workspace:,} B for a {PREFILL_CHUNK}-token chunk of the batch, "
               f"KV {plan.kv_per_token:,} B per token for all {batch} sequences). "
               f"Hint: round down.")


# --- 2. the floor under a decode step ----------------------------------------------------


def decode_floor_ms_solution(config, dtype: torch.dtype, context: int, bandwidth: float) -> float:
    """Milliseconds to read every weight once and the K/V of ``context`` tokens once."""
    return 1e3 * decode_bytes(config, dtype, context) / bandwidth


FLOOR_CASES = [  # (config, dtype, context, bandwidth in bytes/s)
    ("qwen3-4b", torch.bfloat16, 32768, 360e9),  # a 12 GB card's class of bandwidth
    ("llama-3.2-3b", torch.float16, 8192, 1e12),
    ("qwen2.5-3b", torch.bfloat16, 4096, 300e9),
    ("smollm2-135m", torch.float32, 1024, 20e9),  # a laptop CPU
    # as its bigger siblings: the table is not read whole
    ("qwen2.5-3b untied", torch.bfloat16, 4096, 300e9),
]
RTOL = 1e-3


def _config(name: str):
    """A shipped config; "<name> untied" is the same with its own output head (not tied)."""
    config = load_config(name.removesuffix(" untied"))
    if name.endswith(" untied"):
        config.tie_word_embeddings = False
    return config


@check
def check_decode_floor(fn) -> None:
    """``fn(config, dtype, context, bandwidth)`` -> the floor in ms, within 0.1%."""
    for name, dtype, context, bw in FLOOR_CASES:
        config = _config(name)
        got = attempt(fn, config, dtype, context, bw)
        want = decode_floor_ms_solution(config, dtype, context, bw)
        kv = kv_bytes_per_token(config, dtype) * context
        weights = decode_bytes(config, dtype, context) - kv
        head = ("the tied embedding is read once, as the output head."
                if config.tie_word_embeddings else "the untied embedding table is not read whole.")
        expect(got is not None and abs(float(got) - want) <= RTOL * want,
               f"{name} in {_name(dtype)} at {context:,} tokens, {bw / 1e9:g} GB/s: you said "
               f"{got} ms, the floor is {want:.3f} ms = ({weights:,} B of weights read + {kv:,} B "
               f"of K/V) / bandwidth. Hint: milliseconds, not seconds; {head}")
