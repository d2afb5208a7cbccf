"""Notebook 04's exercise checks, and the wrong answers each must catch."""

import torch
import torch.nn.functional as F
from exercises import nb04
from helpers import check_tests


def wrong_strides(max_seq, n_kv_heads, head_dim, layout):
    return (max_seq * head_dim, head_dim, 1)  # the head-major answer for both layouts


def wrong_bytes(config, seq, dtype):  # counts the KV heads, not the query heads
    return 2 * config.num_key_value_heads * seq * nb04.head_dim(config) * dtype.itemsize


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
    (nb04.check_view_strides, nb04.view_strides_solution, [wrong_strides]),
    (nb04.check_repeat_kv_bytes, nb04.repeat_kv_bytes_solution, [wrong_bytes]),
    (nb04.check_chunk_attention, nb04.chunk_attention_solution,
     [interleaved_mask, no_offset, copying]),
]

test_check = check_tests(nb04, CASES)


def test_chunk_solution_matches_gqa_with_a_mask():
    for case in nb04.CHUNK_CASES:
        q, k, v = nb04._chunk_inputs(*case)
        t = case[3]
        assert torch.allclose(nb04.chunk_attention_solution(q, k, v, t),
                              nb04._chunk_reference(q, k, v, t), atol=1e-5)
