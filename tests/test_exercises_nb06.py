"""Notebook 06's exercise checks, and the wrong answers each must catch."""


from exercises import nb06
from helpers import check_tests

from kvlib.cards import CARDS


def longest_no_batch(config, dtype, batch, budget_bytes):  # KV priced for one sequence only
    return nb06.longest_context_solution(config, dtype, 1, budget_bytes)


def longest_fixed_workspace(config, dtype, batch, budget_bytes):  # a chunk's, with nothing cached
    weights = nb06.weight_bytes(config, dtype)
    workspace = nb06.workspace_bytes(config, dtype, nb06.PREFILL_CHUNK, batch)
    return (budget_bytes - weights - workspace) // nb06.kv_bytes_per_token(config, dtype, batch)


def longest_no_workspace(config, dtype, batch, budget_bytes):
    per_token = nb06.kv_bytes_per_token(config, dtype, batch)
    return (budget_bytes - nb06.weight_bytes(config, dtype)) // per_token


def floor_in_seconds(config, dtype, context, bandwidth):
    return nb06.decode_floor_ms_solution(config, dtype, context, bandwidth) / 1e3


def floor_weights_only(config, dtype, context, bandwidth):  # forgets the K/V reads
    return nb06.decode_floor_ms_solution(config, dtype, 0, bandwidth)


def floor_whole_embedding(config, dtype, context, bandwidth):  # reads an untied table whole too
    table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    extra_ms = 1e3 * table * dtype.itemsize / bandwidth
    return nb06.decode_floor_ms_solution(config, dtype, context, bandwidth) + extra_ms


def card_uncapped(config, dtype, card, cache):  # forgets the model's positions
    plan = nb06.plan_budget(config, dtype, card.memory, prefill_chunk=nb06.PREFILL_CHUNK,
                            cache=cache)
    return plan.max_context, card.predicted_ms_per_token(config, dtype, plan.max_context, cache)


def card_cat_without_copy(config, dtype, card, cache):  # prices a cat step as a prealloc one
    context, _ = nb06.predict_card_solution(config, dtype, card, cache)
    return context, card.predicted_ms_per_token(config, dtype, context, "prealloc")


def card_in_seconds(config, dtype, card, cache):
    context, ms = nb06.predict_card_solution(config, dtype, card, cache)
    return context, ms / 1e3


def card_prealloc_plan_for_cat(config, dtype, card, cache):  # one plan for both caches
    context, ms = nb06.predict_card_solution(config, dtype, card, "prealloc")
    return context, card.predicted_ms_per_token(config, dtype, context, cache)


CASES = [
    (nb06.check_longest_context, nb06.longest_context_solution,
     [longest_no_batch, longest_fixed_workspace, longest_no_workspace]),
    (nb06.check_decode_floor, nb06.decode_floor_ms_solution,
     [floor_in_seconds, floor_weights_only, floor_whole_embedding]),
    (nb06.check_predict_card, nb06.predict_card_solution,
     [card_uncapped, card_cat_without_copy, card_in_seconds, card_prealloc_plan_for_cat]),
]

test_check = check_tests(nb06, CASES)


def test_the_asked_case_is_first_and_fits():
    name, dtype, batch, gib = nb06.LONGEST_CASES[0]
    assert (name, batch, gib) == ("llama-3.2-3b", 4, 24)
    assert nb06.longest_context_solution(nb06.load_config(name), dtype, batch, gib * nb06.GIB) > 0


def test_the_new_cards_are_new_and_each_limit_is_met():
    """No card of the exercise is in the notebook's table, and its cases meet both limits: the
    model's positions (the L4) and memory (the 8 GB card)."""
    assert not set(nb06.NEW_CARDS) & set(CARDS)
    name, _, card, cache = nb06.PREDICT_CASES[0]
    assert (name, card, cache) == ("qwen3-4b", "L4", "prealloc")
    limits = set()
    for name, dtype, card, cache in nb06.PREDICT_CASES:
        config = nb06.load_config(name)
        context, _ = nb06.predict_card_solution(config, dtype, nb06.NEW_CARDS[card], cache)
        limits.add("window" if context == config.max_position_embeddings else "memory")
        assert context > 0
    assert limits == {"window", "memory"}
