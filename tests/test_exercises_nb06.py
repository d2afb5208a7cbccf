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


def need_no_workspace(config, dtype, context, ms, cache):  # weights and KV only
    _, bandwidth = nb06.card_needed_solution(config, dtype, context, ms, cache)
    parts = nb06.plan_budget(config, dtype, nb06.GIB, cache=cache).breakdown(context)
    return parts["weights"] + parts["kv"], bandwidth


def need_cat_without_copy(config, dtype, context, ms, cache):  # prices a cat step as prealloc's
    memory, _ = nb06.card_needed_solution(config, dtype, context, ms, cache)
    return memory, nb06.card_needed_solution(config, dtype, context, ms, "prealloc")[1]


def need_ms_as_seconds(config, dtype, context, ms, cache):
    memory, bandwidth = nb06.card_needed_solution(config, dtype, context, ms, cache)
    return memory, bandwidth / 1e3


CASES = [
    (nb06.check_longest_context, nb06.longest_context_solution,
     [longest_no_batch, longest_fixed_workspace, longest_no_workspace]),
    (nb06.check_decode_floor, nb06.decode_floor_ms_solution,
     [floor_in_seconds, floor_weights_only, floor_whole_embedding]),
    (nb06.check_card_needed, nb06.card_needed_solution,
     [need_no_workspace, need_cat_without_copy, need_ms_as_seconds]),
]

test_check = check_tests(nb06, CASES, notes={nb06.check_card_needed: "meet both"})


def test_the_asked_case_is_first_and_fits():
    name, dtype, batch, gib = nb06.LONGEST_CASES[0]
    assert (name, batch, gib) == ("llama-3.2-3b", 4, 24)
    assert nb06.longest_context_solution(nb06.load_config(name), dtype, batch, gib * nb06.GIB) > 0


def test_the_card_needed_is_the_least_that_holds_the_context():
    """The memory is exact: the plan reaches the context with it and not with one byte less. The
    asked case is first, and its cards split: some meet both numbers, some only the memory."""
    assert nb06.NEEDED_CASES[0][:2] == ("qwen3-4b", nb06.torch.bfloat16)
    assert not set(nb06.NEW_CARDS) & set(CARDS)
    for name, dtype, context, ms, cache in nb06.NEEDED_CASES:
        config = nb06.load_config(name)
        memory, _ = nb06.card_needed_solution(config, dtype, context, ms, cache)

        def longest(budget, config=config, dtype=dtype, cache=cache):
            return nb06.plan_budget(config, dtype, budget, cache=cache).max_context

        assert longest(memory) >= context > longest(memory - 1)
    assert nb06.NEEDED_CASES[0][2] == nb06.load_config("qwen3-4b").max_position_embeddings
