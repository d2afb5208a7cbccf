"""Notebook 00's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb00
from helpers import check_tests

from kvlib.budget import plan_budget
from kvlib.config import GIB, head_dim, kv_bytes_per_token, load_config


def _per_token(config, dtype):  # K and V of one token, all layers: built here, not called
    L, Hkv = config.num_hidden_layers, config.num_key_value_heads
    return 2 * L * Hkv * head_dim(config) * dtype.itemsize


def no_padding(config, dtype, lengths):  # counts the real tokens, forgets the padding
    return sum(lengths) * _per_token(config, dtype)


def one_sequence(config, dtype, lengths):  # forgets the batch
    return max(lengths) * _per_token(config, dtype)


def k_only(config, dtype, lengths):  # forgets V
    return len(lengths) * max(lengths) * _per_token(config, dtype) // 2


def query_heads(config, dtype, lengths):  # caches every query head
    group = config.num_attention_heads // config.num_key_value_heads
    return group * len(lengths) * max(lengths) * _per_token(config, dtype)


def calls_the_helper(config, dtype, lengths):  # what exercise 1 asks the learner to build
    return len(lengths) * max(lengths) * kv_bytes_per_token(config, dtype)


LLAMA = load_config("llama-3.2-3b")
KV = _per_token(LLAMA, torch.float16)
ID = 8  # a token's id, int64: the only workspace that grows with the context
AT_12, AT_15 = (plan_budget(LLAMA, torch.float16, g * GIB).max_context for g in (12, 15))


def in_fp32():  # a T4 runs fp16
    return 3 * GIB // (2 * KV + ID)


def k_alone():  # forgets V
    return 3 * GIB // (KV // 2 + ID)


def in_gb():  # 3 GB, not 3 GiB
    return 3 * 10**9 // (KV + ID)


def whole_context():  # the T4's whole context, not what the 3 GiB add
    return AT_15


def _wrong(answer) -> bool:
    """Whether an answer misses the plan by more than the check's 1%."""
    return abs(answer() - (AT_15 - AT_12)) > (AT_15 - AT_12) / 100


def asks_the_plan():  # what exercise 2 asks the learner to predict
    config = load_config("llama-3.2-3b")
    return (plan_budget(config, torch.float16, 15 * GIB).max_context
            - plan_budget(config, torch.float16, 12 * GIB).max_context)


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
    (nb00.check_batch_kv_bytes, nb00.batch_kv_bytes_solution,
     [no_padding, one_sequence, k_only, query_heads]),
    (nb00.check_extra_tokens_on_t4, nb00.extra_tokens_on_t4_solution,
     [f for f in (in_fp32, k_alone, in_gb, whole_context, lambda: 1) if _wrong(f)]),
    (nb00.check_capped_cache, nb00.CappedCatCacheSolution,
     [NeverRefuses, RefusesAtTheBudget, WritesFirst, NoNumbers, CountsTokens]),
]

test_check = check_tests(nb00, CASES, notes={nb00.check_batch_kv_bytes: "47% of the cache is padd",
                                             nb00.check_extra_tokens_on_t4: f"{AT_15:,}"})


def test_hidden_helpers(capsys):
    """A learner's function that calls what the exercise builds is told so, and the helpers are
    back once the check is done."""
    nb00.check_batch_kv_bytes(calls_the_helper)
    assert "`kv_bytes_per_token`" in capsys.readouterr().out
    nb00.check_extra_tokens_on_t4(asks_the_plan)
    assert "`plan_budget`" in capsys.readouterr().out
    assert calls_the_helper(LLAMA, torch.float16, [1]) == KV  # restored
    assert asks_the_plan() == AT_15 - AT_12


def test_wrong_answers_get_their_hint(capsys):
    """A prediction lands near a known mistake, not on it: the hint must still find it."""
    for wrong, words in ((in_fp32, "fp32"), (k_alone, "but not V"), (in_gb, "2^30"),
                         (whole_context, "MORE"), (lambda: in_gb() + 50, "2^30")):
        if not _wrong(wrong):
            continue
        nb00.check_extra_tokens_on_t4(wrong)
        assert words in capsys.readouterr().out


def test_solution_is_arithmetic_not_the_plan():
    """Exercise 2's arithmetic lands within a few tokens of the plan (which counts whole chunks)."""
    got, want = nb00.extra_tokens_on_t4_solution(), AT_15 - AT_12
    assert abs(got - want) <= 8, (got, want)


def test_t4_answer_is_bf16s():
    """fp16 and bf16 are the same size, so the same context."""
    config = load_config("llama-3.2-3b")
    assert nb00.llama_on_t4() == plan_budget(config, torch.float16, 15 * GIB).max_context \
        == plan_budget(config, torch.bfloat16, 15 * GIB).max_context


def test_padding_gets_its_hint(capsys):
    """Counting only the real tokens is the mistake exercise 1 is about: its hint must name it."""
    nb00.check_batch_kv_bytes(no_padding)
    assert "padded to the longest" in capsys.readouterr().out
