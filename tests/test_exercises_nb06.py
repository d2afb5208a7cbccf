"""Notebook 06's exercise checks, and the wrong answers each must catch."""


import types

import pytest
from exercises import nb06
from helpers import check_tests

import kvlib.budget
from kvlib.budget import plan_budget
from kvlib.cards import CARDS


def _unhidden(fn):
    """A copy of a reference solution that a check's hiding does not reach, for the wrong answers
    built on it: its globals are a snapshot of the module's, taken before any check runs."""
    return types.FunctionType(fn.__code__, dict(vars(nb06)), fn.__name__, fn.__defaults__)


LONGEST = _unhidden(nb06.longest_context_solution)
FLOOR = _unhidden(nb06.decode_floor_ms_solution)
NEEDED = _unhidden(nb06.card_needed_solution)
LOST = _unhidden(nb06.tokens_lost_solution)


def longest_no_batch(config, dtype, batch, budget_bytes):  # KV priced for one sequence only
    return LONGEST(config, dtype, 1, budget_bytes)


def longest_fixed_workspace(config, dtype, batch, budget_bytes):  # a chunk's, with nothing cached
    weights = nb06.weight_bytes(config, dtype)
    workspace = nb06.workspace_bytes(config, dtype, nb06.PREFILL_CHUNK, batch)
    return (budget_bytes - weights - workspace) // nb06.kv_bytes_per_token(config, dtype, batch)


def longest_no_workspace(config, dtype, batch, budget_bytes):
    per_token = nb06.kv_bytes_per_token(config, dtype, batch)
    return (budget_bytes - nb06.weight_bytes(config, dtype)) // per_token


def floor_in_seconds(config, dtype, context, bandwidth):
    return FLOOR(config, dtype, context, bandwidth) / 1e3


def floor_weights_only(config, dtype, context, bandwidth):  # forgets the K/V reads
    return FLOOR(config, dtype, 0, bandwidth)


def floor_whole_embedding(config, dtype, context, bandwidth):  # reads an untied table whole too
    table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    extra_ms = 1e3 * table * dtype.itemsize / bandwidth
    return FLOOR(config, dtype, context, bandwidth) + extra_ms


def need_no_workspace(config, dtype, context, ms, cache):  # weights and KV only
    _, bandwidth = NEEDED(config, dtype, context, ms, cache)
    kv = nb06.kv_bytes_per_token(config, dtype) * context
    return nb06.weight_bytes(config, dtype) + kv, bandwidth


def need_prealloc_workspace(config, dtype, context, ms, cache):  # one workspace for both caches
    _, bandwidth = NEEDED(config, dtype, context, ms, cache)
    return NEEDED(config, dtype, context, ms, "prealloc")[0], bandwidth


def need_cat_without_copy(config, dtype, context, ms, cache):  # prices a cat step as prealloc's
    memory, _ = NEEDED(config, dtype, context, ms, cache)
    return memory, NEEDED(config, dtype, context, ms, "prealloc")[1]


def need_ms_as_seconds(config, dtype, context, ms, cache):
    memory, bandwidth = NEEDED(config, dtype, context, ms, cache)
    return memory, bandwidth / 1e3


def lost_kv_only(config, dtype, budget_bytes, overhead_bytes):  # forgets the workspace shrinks
    return overhead_bytes // nb06.kv_bytes_per_token(config, dtype)


def lost_as_a_change(config, dtype, budget_bytes, overhead_bytes):  # the sign of a difference
    return -LOST(config, dtype, budget_bytes, overhead_bytes)


def lost_whole_budget(config, dtype, budget_bytes, overhead_bytes):  # the context left, not lost
    return LONGEST(config, dtype, 1, budget_bytes - overhead_bytes)


CASES = [
    (nb06.check_longest_context, nb06.longest_context_solution,
     [longest_no_batch, longest_fixed_workspace, longest_no_workspace]),
    (nb06.check_decode_floor, nb06.decode_floor_ms_solution,
     [floor_in_seconds, floor_weights_only, floor_whole_embedding]),
    (nb06.check_card_needed, nb06.card_needed_solution,
     [need_no_workspace, need_prealloc_workspace, need_cat_without_copy,
      need_ms_as_seconds]),
    (nb06.check_tokens_lost, nb06.tokens_lost_solution,
     [lost_kv_only, lost_as_a_change, lost_whole_budget]),
]

test_check = check_tests(nb06, CASES, notes={nb06.check_card_needed: "meet both",
                                             nb06.check_tokens_lost: "overhead / KV per token"})


def test_the_asked_case_is_first_and_fits():
    name, dtype, batch, gib = nb06.LONGEST_CASES[0]
    assert (name, batch, gib) == ("llama-3.2-3b", 4, 24)
    assert nb06.longest_context_solution(nb06.load_config(name), dtype, batch, gib * nb06.GIB) > 0


def test_the_card_needed_is_the_least_that_holds_the_context():
    """The reference memory is the plan's least budget, within the check's slack (RoPE's buffers),
    and its floor reads what kvlib's does. The asked case is first: the model's whole window."""
    assert nb06.NEEDED_CASES[0][:3] == ("qwen3-4b", nb06.torch.bfloat16, 40960)
    assert nb06.load_config("qwen3-4b").max_position_embeddings == 40960
    assert not set(nb06.NEW_CARDS) & set(CARDS)
    for name, dtype, context, ms, cache in nb06.NEEDED_CASES:
        config = nb06.load_config(name)
        memory, bandwidth = nb06.card_needed_solution(config, dtype, context, ms, cache)
        def longest(budget, config=config, dtype=dtype, cache=cache):
            return nb06.plan_budget(config, dtype, budget, cache=cache).max_context

        assert longest(memory + nb06.SLACK) >= context > longest(memory - nb06.SLACK)
        assert bandwidth * ms / 1e3 == pytest.approx(nb06.step_bytes(config, dtype, context, cache))
        assert nb06.read_bytes(config, dtype, context) == nb06.decode_bytes(config, dtype, context)


def test_a_helper_the_exercise_builds_is_hidden_while_the_check_runs(capsys):
    def by_plan_budget(config, dtype, batch, budget_bytes):
        return plan_budget(config, dtype, budget_bytes, batch=batch).max_context

    nb06.check_longest_context(by_plan_budget)
    assert "builds what `plan_budget` does" in capsys.readouterr().out
    nb06.check_card_needed(lambda *args: nb06.card_needed_solution(*args))  # the notebook has nb06
    assert "builds what `card_needed_solution` does" in capsys.readouterr().out
    # restored after the call, in the module and among the caller's names
    assert plan_budget is nb06.plan_budget is kvlib.budget.plan_budget
    assert kvlib.budget.Budget.__name__ == "Budget"
    nb06.check_longest_context(nb06.longest_context_solution)  # the pieces are not hidden
    assert capsys.readouterr().out == "correct\n"


def test_a_real_card_loses_fewer_tokens_than_its_overhead_in_kv():
    """The workspace shrinks with the context, so each token freed gives back more than its KV."""
    for name, dtype, gib, mib in nb06.LOST_CASES:
        config = nb06.load_config(name)
        lost = nb06.tokens_lost_solution(config, dtype, gib * nb06.GIB, mib * nb06.MIB)
        assert 0 < lost <= mib * nb06.MIB // nb06.kv_bytes_per_token(config, dtype)
        budget, taken = gib * nb06.GIB, mib * nb06.MIB
        assert lost == (plan_budget(config, dtype, budget).max_context
                        - plan_budget(config, dtype, budget - taken).max_context)


def test_a_cat_memory_priced_with_prealloc_workspace_names_the_cache_argument(capsys):
    """Exercise 3's likeliest slip, run_workspace at its default cache: the hint names the call."""
    nb06.check_card_needed(need_prealloc_workspace)
    out = capsys.readouterr().out
    assert 'run_workspace(config, dtype, context, 512, cache="cat")' in out
    assert "correct" not in out
