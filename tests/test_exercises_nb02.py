"""Notebook 02's exercise checks, and the wrong answers each must catch."""

from exercises import nb02
from helpers import check_tests


# "at least" instead of "more than": one slot early when it divides
def over_or_equal(config, dtype, limit):
    per_token = nb02.step_bytes_solution(config, dtype, 0)
    return -(-limit // per_token) - 1


def over_k_only(config, dtype, limit):  # counts K and forgets V: twice too far
    return 2 * nb02.first_slot_over_solution(config, dtype, limit) + 1


def over_plus_one(config, dtype, limit):  # one slot late
    return nb02.first_slot_over_solution(config, dtype, limit) + 1


def cumulative_linear(config, dtype, prompt, steps):  # every step priced at the prompt length
    return steps * nb02.step_bytes_solution(config, dtype, prompt)


def cumulative_from_zero(config, dtype, prompt, steps):  # forgets the prompt already cached
    return nb02.cumulative_bytes_solution(config, dtype, 0, steps)


CASES = [
    (nb02.check_first_slot_over, nb02.first_slot_over_solution,
     [over_or_equal, over_k_only, over_plus_one]),
    (nb02.check_cumulative_bytes, nb02.cumulative_bytes_solution,
     [cumulative_linear, cumulative_from_zero]),
]

test_check = check_tests(nb02, CASES)


def test_closed_form_is_the_sum_of_steps():
    config = nb02.load_config("smollm2-135m")
    p, n = 37, 11
    total = sum(nb02.step_bytes_solution(config, nb02.torch.float32, p + i) for i in range(n))
    assert nb02.cumulative_bytes_solution(config, nb02.torch.float32, p, n) == total
