"""Notebook 08's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb08
from helpers import check_tests


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
    code, scale = nb08.quantize_solution(x)
    return code, scale[..., 0]


def quantize_zero_row_nan(x):  # an all-zero row divides 0 by 0
    scale = x.abs().amax(-1, keepdim=True) / 127
    return (x / scale).round().to(torch.int8), scale


def bytes_no_scales(config):
    scales = 2 * config.num_hidden_layers * config.num_key_value_heads * 2
    return nb08.int8_bytes_solution(config) - scales


def bytes_k_only(config):
    return nb08.int8_bytes_solution(config) // 2


def bytes_query_heads(config):
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return nb08.int8_bytes_solution(config) * heads // kv_heads


CASES = [
    (nb08.check_slot, nb08.slot_solution,
     [slot_ignores_sinks, slot_without_offset, slot_ring_over_everything]),
    (nb08.check_quantize, nb08.quantize_solution,
     [quantize_per_tensor, quantize_truncating, quantize_by_128, quantize_flat_scale]),
    (nb08.check_int8_bytes, nb08.int8_bytes_solution, [bytes_no_scales, bytes_k_only,
                                                       bytes_query_heads]),
]

test_check = check_tests(nb08, CASES)
