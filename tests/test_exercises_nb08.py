"""Notebook 08's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb08
from helpers import check_tests

from kvlib.budget import plan_kv, run_workspace, weight_bytes
from kvlib.config import head_dim, kv_heads
from kvlib.quant_cache import quantize


def slot_ignores_sinks(p, window, sinks):
    return p % window


def slot_without_offset(p, window, sinks):
    return p if p < sinks else (p - sinks) % window


def slot_ring_over_everything(p, window, sinks):
    return p % (window + sinks)


def quantize_per_tensor(x):  # one scale for everything: small rows lose their precision
    scale = (x.abs().amax() / 127).expand(*x.shape[:-1], 1)
    return (x / scale).round().to(torch.int8), scale


def quantize_truncating(x):  # no rounding: up to a whole step off
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (x / scale).to(torch.int8), scale


def quantize_by_128(x):  # the largest element becomes 128, which int8 wraps to -128
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 128
    return (x / scale).round().to(torch.int8), scale


def quantize_flat_scale(x):  # right values, but the scale has no axis to broadcast over
    scale = (x.abs().amax(-1) / 127).clamp_min(1e-30)
    return (x / scale[..., None]).round().to(torch.int8), scale


def quantize_zero_row_nan(x):  # an all-zero row divides 0 by 0
    scale = x.abs().amax(-1, keepdim=True) / 127
    return (x / scale).round().to(torch.int8), scale


def quantize_with_kvlib(x):  # kvlib's own quantize does the exercise: the check hides it
    code, scale = quantize(x, 8, x.shape[-1])
    return code, scale[..., 0, :]


def _bisect(config, budget_bytes, per_token, extra, workspace=True):
    """The longest context whose weights, KV, workspace and ``extra`` bytes a token fit."""
    weights = weight_bytes(config, torch.bfloat16)

    def fits(context):
        used = weights + per_token * context + extra * context
        if workspace:
            used += run_workspace(config, torch.bfloat16, context)
        return used <= budget_bytes

    lo, hi = 0, (budget_bytes - weights) // per_token + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _shape(config):
    return config.num_hidden_layers, kv_heads(config), head_dim(config)


def int4_bytes(config, scales=True):
    layers, kv, d = _shape(config)
    return 2 * layers * kv * (d // 2 + (d // 32 * 2 if scales else 0))


def longest_bisected(config, budget_bytes):  # a learner's own bisection: within the tolerance
    layers, kv, d = _shape(config)
    return _bisect(config, budget_bytes, int4_bytes(config), 5 * kv * d)


def longest_no_copy(config, budget_bytes):
    return _bisect(config, budget_bytes, int4_bytes(config), 0)


def longest_bf16_copy_only(config, budget_bytes):
    layers, kv, d = _shape(config)
    return _bisect(config, budget_bytes, int4_bytes(config), 4 * kv * d)


def longest_no_scales(config, budget_bytes):
    layers, kv, d = _shape(config)
    return _bisect(config, budget_bytes, int4_bytes(config, scales=False), 5 * kv * d)


def longest_no_workspace(config, budget_bytes):
    layers, kv, d = _shape(config)
    return _bisect(config, budget_bytes, int4_bytes(config), 5 * kv * d, workspace=False)


def longest_with_plan_kv(config, budget_bytes):  # the plan does the exercise: the check hides it
    return plan_kv(config, torch.bfloat16, budget_bytes, "int4").max_context


CASES = [
    (nb08.check_slot, nb08.slot_solution,
     [slot_ignores_sinks, slot_without_offset, slot_ring_over_everything]),
    (nb08.check_quantize, nb08.quantize_solution,
     [quantize_per_tensor, quantize_truncating, quantize_by_128, quantize_flat_scale]),
    (nb08.check_longest_int4, nb08.longest_int4_solution,
     [longest_no_copy, longest_bf16_copy_only, longest_no_scales, longest_no_workspace]),
]

# The note answers exercise 3's PREDICT question with Qwen3-4B's numbers.
test_check = check_tests(nb08, CASES, notes={
    nb08.check_longest_int4: "115,821 int4 tokens with the copy left out, 103,095 with it "
                             "priced: the copy costs 12,726 tokens"})


def test_own_bisection_is_correct(capsys):
    """A learner's bisection on weight_bytes and run_workspace, without RoPE's few bytes, passes."""
    nb08.check_longest_int4(longest_bisected)
    assert capsys.readouterr().out.splitlines()[0] == "correct"


def test_helpers_are_hidden(capsys):
    """kvlib's quantize and plan_kv would do exercises 2 and 3: the checks refuse them."""
    nb08.check_quantize(quantize_with_kvlib)
    nb08.check_longest_int4(longest_with_plan_kv)
    out = capsys.readouterr().out.splitlines()
    assert [line.split("`")[1] for line in out] == ["quantize", "plan_kv"], out
