"""Notebook 00's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb00
from helpers import check_tests

from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config


def one_sequence(config, dtype, batch, context):  # forgets the batch
    return nb00.batch_kv_bytes_solution(config, dtype, 1, context)


def k_only(config, dtype, batch, context):  # forgets V
    return nb00.batch_kv_bytes_solution(config, dtype, batch, context) // 2


def query_heads(config, dtype, batch, context):  # caches every query head
    group = config.num_attention_heads // config.num_key_value_heads
    return group * nb00.batch_kv_bytes_solution(config, dtype, batch, context)


def llama_fp32():  # a T4 does not run fp32 here
    return plan_budget(load_config("llama-3.2-3b"), torch.float32, 15 * GIB).max_context


def llama_16gib():
    return plan_budget(load_config("llama-3.2-3b"), torch.float16, 16 * GIB).max_context


class NeverRefuses(nb00.CappedCatCacheSolution):
    def write(self, layer, start, k, v):
        nb00.CatCache.write(self, layer, start, k, v)


class RefusesAtTheBudget(nb00.CappedCatCacheSolution):  # >= instead of >: refuses an exact fit
    def write(self, layer, start, k, v):
        after = self.nbytes + (start + k.shape[0] - self.k[layer].shape[2]) * 2 * k[0].nbytes
        if after >= self.budget_bytes:
            raise ValueError(f"over budget: {after} >= {self.budget_bytes}")
        nb00.CatCache.write(self, layer, start, k, v)


class WritesFirst(nb00.CappedCatCacheSolution):  # the refused write has already happened
    def write(self, layer, start, k, v):
        nb00.CatCache.write(self, layer, start, k, v)
        if self.nbytes > self.budget_bytes:
            raise ValueError(f"over budget: {self.nbytes} > {self.budget_bytes}")


class NoNumbers(nb00.CappedCatCacheSolution):
    def write(self, layer, start, k, v):
        try:
            super().write(layer, start, k, v)
        except ValueError:
            raise ValueError("over budget") from None


class CountsTokens(nb00.CappedCatCacheSolution):  # whole tokens: refuses a chunk one layer fits
    def write(self, layer, start, k, v):
        if (start + k.shape[0]) * self.bytes_per_token > self.budget_bytes:
            raise ValueError(f"over budget: {start + k.shape[0]} tokens")
        nb00.CatCache.write(self, layer, start, k, v)


CASES = [
    (nb00.check_batch_kv_bytes, nb00.batch_kv_bytes_solution, [one_sequence, k_only, query_heads]),
    (nb00.check_llama_on_t4, nb00.llama_on_t4_solution, [llama_fp32, llama_16gib, lambda: 1]),
    (nb00.check_capped_cache, nb00.CappedCatCacheSolution,
     [NeverRefuses, RefusesAtTheBudget, WritesFirst, NoNumbers, CountsTokens]),
]

test_check = check_tests(nb00, CASES, notes={nb00.check_batch_kv_bytes: "4 conversations"})


def test_t4_answer_is_bf16s():
    """The point of exercise 2: fp16 and bf16 are the same size, so the same context."""
    config = load_config("llama-3.2-3b")
    assert nb00.llama_on_t4_solution() == plan_budget(config, torch.float16, 15 * GIB).max_context \
        == plan_budget(config, torch.bfloat16, 15 * GIB).max_context
