"""Notebook 04's exercise checks, and the wrong answers each must catch."""

import torch
import torch.nn.functional as F
from exercises import nb04
from helpers import check_tests


def wrong_strides(max_seq, n_kv_heads, head_dim, layout):
    return (max_seq * head_dim, head_dim, 1)  # the head-major answer for both layouts


def wrong_bytes(config, seq, dtype):  # counts the KV heads, not the query heads
    return 2 * config.num_key_value_heads * seq * nb04.head_dim(config) * dtype.itemsize


def wrong_pairing(q, k, v):  # query head i with KV head i % n_kv: the interleaved order
    h_q, h_kv, d = q.shape[1], k.shape[1], q.shape[-1]
    folded = q.reshape(1, h_q // h_kv, h_kv, d).transpose(1, 2)
    return F.scaled_dot_product_attention(folded, k, v).transpose(1, 2).reshape(1, h_q, 1, d)


def copying(q, k, v):  # right answer, but expands K/V with a copy
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


CASES = [
    (nb04.check_view_strides, nb04.view_strides_solution, [wrong_strides]),
    (nb04.check_repeat_kv_bytes, nb04.repeat_kv_bytes_solution, [wrong_bytes]),
    (nb04.check_gqa_fold, nb04.gqa_fold_solution, [wrong_pairing, copying]),
]

test_check = check_tests(nb04, CASES)


def test_fold_is_a_view_and_matches_gqa():
    q, k, v = nb04._gqa_inputs()
    assert torch.allclose(nb04.gqa_fold_solution(q, k, v),
                          F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5)
