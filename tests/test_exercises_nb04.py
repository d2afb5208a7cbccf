"""Notebook 04's exercise checks, and the wrong answers each must catch."""

import torch
import torch.nn.functional as F
from exercises import nb04
from helpers import check_tests


def offset_one_layout(max_seq, n_kv_heads, head_dim, layer, head, slot, layout):
    # the head-major answer for both layouts
    return ((layer * n_kv_heads + head) * max_seq + slot) * head_dim


def offset_layer_zero(max_seq, n_kv_heads, head_dim, layer, head, slot, layout):
    # forgets the layers before this one
    return nb04.view_offset_solution(max_seq, n_kv_heads, head_dim, 0, head, slot, layout)


def runs_ignore_heads(n_kv_heads, t, layout):  # misses that one KV head leaves no gaps
    return t + 1 if layout == "seq" else 1


def runs_swapped(n_kv_heads, t, layout):  # the write's runs, not the read's
    return 1 if layout == "seq" else t + 1


def _per_token(config, dtype):
    """(weights, cache bytes per token, one layer's repeat_kv copy per token), by hand."""
    d, size = nb04.head_dim(config), dtype.itemsize
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * d * size
    return nb04.weight_bytes(config, dtype), cache, 2 * config.num_attention_heads * d * size


def no_copy(config, dtype, budget):  # the limit of the cache alone
    weights, cache, _ = _per_token(config, dtype)
    return (budget - weights) // cache


def every_layer_copy(config, dtype, budget):  # as if all layers' copies were live at once
    weights, cache, copy = _per_token(config, dtype)
    return (budget - weights) // (cache + config.num_hidden_layers * copy)


def kv_heads_copy(config, dtype, budget):  # the copy sized by the KV heads, not the query heads
    weights, cache, _ = _per_token(config, dtype)
    return (budget - weights) // (cache + cache // config.num_hidden_layers)


def no_weights(config, dtype, budget):  # the whole card for the cache and the copy
    _, cache, copy = _per_token(config, dtype)
    return budget // (cache + copy)


def off_by_one(config, dtype, budget):  # the first context that does not fit
    return nb04.repeat_kv_limit_solution(config, dtype, budget) + 1


def interleaved_mask(q, k, v, t):  # the right fold, but the mask rows in the wrong order
    h_q, n, d = q.shape[1], q.shape[2], q.shape[3]
    h_kv = k.shape[1]
    group = h_q // h_kv
    visible = torch.ones(n, t + n, dtype=torch.bool).tril(t)
    out = F.scaled_dot_product_attention(q.reshape(1, h_kv, group * n, d), k, v,
                                         attn_mask=visible.repeat_interleave(group, 0))
    return out.reshape(1, h_q, n, d)


def no_offset(q, k, v, t):  # query i sees slots 0..i, as if the chunk started at slot 0
    h_q, n, d = q.shape[1], q.shape[2], q.shape[3]
    h_kv = k.shape[1]
    visible = torch.ones(n, t + n, dtype=torch.bool).tril(0)
    out = F.scaled_dot_product_attention(q.reshape(1, h_kv, -1, d), k, v,
                                         attn_mask=visible.repeat(h_q // h_kv, 1))
    return out.reshape(1, h_q, n, d)


def copying(q, k, v, t):  # right answer, but expands K/V with a copy
    g, n = q.shape[1] // k.shape[1], q.shape[2]
    visible = torch.ones(n, t + n, dtype=torch.bool).tril(t)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=visible)


CASES = [
    (nb04.check_view_offset, nb04.view_offset_solution, [offset_one_layout, offset_layer_zero]),
    (nb04.check_read_runs, nb04.read_runs_solution, [runs_ignore_heads, runs_swapped]),
    (nb04.check_repeat_kv_limit, nb04.repeat_kv_limit_solution,
     [no_copy, every_layer_copy, kv_heads_copy, no_weights, off_by_one]),
    (nb04.check_chunk_attention, nb04.chunk_attention_solution,
     [interleaved_mask, no_offset, copying]),
]

test_check = check_tests(nb04, CASES, notes={nb04.check_repeat_kv_limit: "29,540 with it"})


def test_hints_name_the_known_mistakes(capsys):
    for wrong, words in [(no_copy, "without the copy"), (every_layer_copy, "layer by layer"),
                         (kv_heads_copy, "query heads"), (no_weights, "weights are on the card")]:
        nb04.check_repeat_kv_limit(wrong)
        assert words in capsys.readouterr().out, wrong.__name__


def test_offset_hints_name_the_known_mistakes(capsys):
    for wrong, words in [(offset_one_layout, "layout='head'"), (offset_layer_zero, "layer 0")]:
        nb04.check_view_offset(wrong)
        assert words in capsys.readouterr().out, wrong.__name__


def test_chunk_solution_matches_gqa_with_a_mask():
    for case in nb04.CHUNK_CASES:
        q, k, v = nb04._chunk_inputs(*case)
        t = case[3]
        assert torch.allclose(nb04.chunk_attention_solution(q, k, v, t),
                              nb04._chunk_reference(q, k, v, t), atol=1e-5)
