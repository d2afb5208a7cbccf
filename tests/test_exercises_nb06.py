"""Notebook 06's exercise checks, and the wrong answers each must catch."""


from exercises import nb06
from helpers import check_tests


def longest_no_batch(config, dtype, batch, budget_bytes):  # KV priced for one sequence only
    return nb06.longest_context_solution(config, dtype, 1, budget_bytes)


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


CASES = [
    (nb06.check_longest_context, nb06.longest_context_solution,
     [longest_no_batch, longest_no_workspace]),
    (nb06.check_decode_floor, nb06.decode_floor_ms_solution,
     [floor_in_seconds, floor_weights_only, floor_whole_embedding]),
]

test_check = check_tests(nb06, CASES)


def test_the_asked_case_is_first_and_fits():
    name, dtype, batch, gib = nb06.LONGEST_CASES[0]
    assert (name, batch, gib) == ("llama-3.2-3b", 4, 24)
    assert nb06.longest_context_solution(nb06.load_config(name), dtype, batch, gib * nb06.GIB) > 0
