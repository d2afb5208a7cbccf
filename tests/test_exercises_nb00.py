"""Notebook 00's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb00
from helpers import check_tests

from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config


def k_only(config, bytes_per_element):  # forgets V
    return nb00.kv_bytes_per_token_solution(config, bytes_per_element) // 2


def query_heads(config, bytes_per_element):  # caches every query head
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    return 2 * layers * heads * nb00.head_dim(config) * bytes_per_element


def llama_fp32():  # a T4 does not run fp32 here
    return plan_budget(load_config("llama-3.2-3b"), torch.float32, 15 * GIB).max_context


def llama_16gib():
    return plan_budget(load_config("llama-3.2-3b"), torch.float16, 16 * GIB).max_context


def new_token_only(config, t, bytes_per_element):
    return nb00.kv_bytes_per_token_solution(config, bytes_per_element)


def old_tokens_only(config, t, bytes_per_element):
    return t * nb00.kv_bytes_per_token_solution(config, bytes_per_element)


CASES = [
    (nb00.check_kv_bytes_per_token, nb00.kv_bytes_per_token_solution, [k_only, query_heads]),
    (nb00.check_llama_on_t4, nb00.llama_on_t4_solution, [llama_fp32, llama_16gib, lambda: 1]),
    (nb00.check_cat_step_bytes, nb00.cat_step_bytes_solution, [new_token_only, old_tokens_only]),
]

test_check = check_tests(nb00, CASES)


def test_t4_answer_is_bf16s():
    """The point of exercise 2: fp16 and bf16 are the same size, so the same context."""
    config = load_config("llama-3.2-3b")
    assert nb00.llama_on_t4_solution() == plan_budget(config, torch.bfloat16, 15 * GIB).max_context
