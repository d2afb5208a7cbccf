"""Exercises of notebook 08 (fewer bytes per token): checks and reference solutions.

Checks run on small CPU tensors and shipped configs, so they print the same thing on every
machine.
"""

from __future__ import annotations

import sys

import torch

from kvlib import budget as kv_budget
from kvlib import quant_cache
from kvlib.budget import Budget, plan_kv, run_workspace, weight_bytes
from kvlib.config import GIB, head_dim, kv_heads, load_config

from .checking import attempt, check, expect, hint

# What exercises 2 and 3 build, hidden from the learner's function while a check calls it. The
# reference solutions are hidden too: the notebook imports this module.
_HERE = sys.modules[__name__]
QUANTIZE = ((quant_cache, "quantize"), (quant_cache, "dequantize"), (_HERE, "quantize_solution"))
PLAN = ((kv_budget, "plan_kv"), (kv_budget, "plan_budget"), (kv_budget, "Budget"),
        (_HERE, "longest_int4_solution"))

# --- 1. the ring's slot index ---------------------------------------------------------------


def slot_solution(p: int, window: int, sinks: int) -> int:
    """The slot of position ``p``: the first ``sinks`` positions keep their own slots, every later
    one goes round a ring of ``window`` slots after them."""
    return p if p < sinks else sinks + (p - sinks) % window


SLOT_CASES = [(4, 0), (4, 2), (5, 1), (1, 3)]  # (window, sinks)


@check
def check_slot(fn) -> None:
    """``fn(p, window, sinks)`` for positions well past the window, as the ring places them."""
    for window, sinks in SLOT_CASES:
        for p in range(3 * (window + sinks) + 2):
            got, want = attempt(fn, p, window, sinks), slot_solution(p, window, sinks)
            known = {p % window: "Only the positions after the sinks go round the ring: the sinks "
                                 "keep slots 0..sinks-1 and the ring starts at slot `sinks`.",
                     (p - sinks) % window: "The ring's slots come after the sinks' own: add "
                                           "`sinks`.",
                     p % (window + sinks): "A sink is never overwritten: the ring turns over "
                                           "`window` slots, not `window + sinks`."}
            expect(got == want, f"slot(p={p}, window={window}, sinks={sinks}): you said {got}, "
                                f"the ring puts it in slot {want}.", hint(got, known))


# --- 2. quantize to int8, per token ---------------------------------------------------------


def quantize_solution(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> int8 codes ``[..., D]`` and one scale per row ``[..., 1]``, symmetric:
    ``scale = max|x| / 127``, ``code = round(x / scale)``, so ``code * scale`` is within half a
    step of ``x``."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(x.dtype).tiny)
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _rows() -> torch.Tensor:
    """``[4, 6, 16]`` rows of very different sizes, an outlier channel and an all-zero row."""
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(8))
    x = x * torch.logspace(-3, 1, 6).view(1, 6, 1)  # rows from 1e-3 to 10
    x[..., 5] *= 8
    x[1, 2] = 0
    return x


@check
def check_quantize(fn) -> None:
    """``fn(x)`` -> ``(code, scale)``: int8 codes in -127..127, a scale per row, and every
    ``code * scale`` within half of that row's step ``max|x| / 127`` of ``x``."""
    x = _rows()
    out = attempt(fn, x.clone(), hide=QUANTIZE)
    expect(isinstance(out, tuple) and len(out) == 2,
           f"return (code, scale), not {type(out).__name__}")
    code, scale = out
    expect(code.dtype == torch.int8 and tuple(code.shape) == tuple(x.shape),
           f"code: {code.dtype} {tuple(code.shape)}, want torch.int8 {tuple(x.shape)}")
    expect(tuple(scale.shape) == (*x.shape[:-1], 1),
           f"scale: shape {tuple(scale.shape)}, want {(*x.shape[:-1], 1)}: one per row (token and "
           f"head), kept as a last axis of 1 so that code * scale broadcasts")
    lo, hi = int(code.min()), int(code.max())
    expect(-127 <= lo and hi <= 127, f"codes span {lo}..{hi}, want -127..127: symmetric, and "
                                     f"-128 has no +128 to mirror it")
    back = code.float() * scale.float()
    expect(not back.isnan().any(), "code * scale has NaN: an all-zero row must not divide by 0")
    step = x.abs().amax(-1, keepdim=True) / 127  # each row's own step
    worst = ((x - back).abs() / step.clamp_min(1e-30)).nan_to_num().amax()
    expect(bool(worst <= 0.5 + 1e-3),
           f"code * scale is up to {worst:.2f} of a row's step max|x|/127 away from x, want "
           f"<= 0.5: round to the nearest code, with each row's own scale")


# --- 3. the longest int4 context, its copy priced ----------------------------------------


def int4_copy_bytes(config) -> int:
    """Bytes per token of context that one layer's ``dequantize`` holds at its peak, in bf16:
    three things alive at once: K's copy (2 bytes an element), V's codes unpacked to one byte an
    element, and V's copy (2 bytes)."""
    return 5 * kv_heads(config) * head_dim(config)


def int4_bytes(config) -> int:
    """K and V, every layer and KV head: ``head_dim / 2`` bytes of codes and a 2-byte scale per
    32 channels."""
    d = head_dim(config)
    return 2 * config.num_hidden_layers * kv_heads(config) * (d // 2 + d // 32 * 2)


def longest_int4_solution(config, budget_bytes: int) -> int:
    """The longest context of ``config`` in bf16 with int4 KV (groups of 32, bf16 scales): the
    weights, the KV, the workspace of a full-precision cache, and one layer's dequantized copy,
    which grows with the context too. Bisect: the workspace is no straight line."""
    weights = weight_bytes(config, torch.bfloat16)
    per_token, copy = int4_bytes(config), int4_copy_bytes(config)

    def fits(context: int) -> bool:
        workspace = run_workspace(config, torch.bfloat16, context)
        return weights + (per_token + copy) * context + workspace <= budget_bytes

    lo, hi = 0, max(0, budget_bytes - weights) // per_token + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _priced(plan, per_token: int, extra: int, workspace: bool = True) -> int:
    """``plan`` with other KV bytes a token and ``extra`` bytes a token of context on top."""
    at = plan._workspace_at if workspace else (lambda context: 0)
    return Budget(plan.weights, per_token, plan.budget,
                  lambda context: at(context) + extra * context).max_context


LONGEST_CASES = [("llama-3.2-3b", 12), ("qwen3-4b", 12), ("qwen2.5-3b", 8), ("smollm2-135m", 1)]


@check
def check_longest_int4(fn) -> str:
    """``fn(config, budget_bytes)`` -> the longest int4 context with the copy priced, within one
    token (the plan also keeps RoPE's 4 * head_dim bytes, under a token's KV). Its note answers
    the notebook's PREDICT question: the tokens the copy costs Qwen3-4B on 12 GiB."""
    note = ""
    for name, gib in LONGEST_CASES:
        config = load_config(name)
        got = attempt(fn, config, gib * GIB, hide=PLAN)
        want = longest_int4_solution(config, gib * GIB)
        plan = plan_kv(config, torch.bfloat16, gib * GIB, "int4")
        copy, kv, d = int4_copy_bytes(config), kv_heads(config), head_dim(config)
        scales = 2 * config.num_hidden_layers * kv * d // 32 * 2
        known = {plan.max_context: "You left the dequantized copy out: one layer's, at the "
                                   "whole context, in bf16.",
                 _priced(plan, plan.kv_per_token, 4 * kv * d): "K's and V's bf16 copies, yes, "
                                                               "but V's unpacked int8 codes are "
                                                               "alive too.",
                 _priced(plan, plan.kv_per_token - scales, copy): "int4 keeps a bf16 scale per "
                                                                  "32 channels: price them.",
                 _priced(plan, plan.kv_per_token, copy, workspace=False):
                     "The workspace grows with the context too: run_workspace(config, "
                     "torch.bfloat16, context)."}
        expect(got is not None and abs(int(got) - want) <= 1,
               f"{name}, bf16 weights, int4 KV, {gib} GiB: you said {got}, the priced plan says "
               f"{want:,} tokens (weights {plan.weights:,} B, KV {plan.kv_per_token:,} B per "
               f"token, copy {copy:,} B per token of context, workspace "
               f"{plan._workspace_at(want):,} B there).", hint(got, known))
        if name == "qwen3-4b":
            lost = plan.max_context - want
            note = (f"{name} on {gib} GiB: {plan.max_context:,} int4 tokens with the copy left "
                    f"out, {want:,} with it priced: the copy costs {lost:,} tokens "
                    f"({lost / plan.max_context:.0%}); it is {copy:,} B per token of context "
                    f"beside int4's {plan.kv_per_token:,} B a token.")
    return note
