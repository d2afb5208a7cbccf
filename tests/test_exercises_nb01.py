"""Notebook 01's exercise checks, and the wrong answers each must catch."""


from exercises import nb01
from helpers import check_tests


def flops_not_macs(config, t):
    return 2 * nb01.step_macs_solution(config, t)


def no_attention(config, t):
    L, D = config.num_hidden_layers, nb01.head_dim(config)
    return nb01.step_macs_solution(config, t) - 2 * L * config.num_attention_heads * D * t * t


def looped(config, p, n):  # a loop is slow but right: the check accepts it
    return sum(nb01.step_flops(config, t) for t in range(p, p + n))


def off_by_one(config, p, n):
    return sum(nb01.step_flops(config, t) for t in range(p + 1, p + n + 1))


def linear_only(config, p, n):
    return sum(2 * nb01.param_count(config) * t for t in range(p, p + n))


CASES = [
    (nb01.check_step_macs, nb01.step_macs_solution, [flops_not_macs, no_attention]),
    (nb01.check_total_flops, nb01.total_flops_solution, [off_by_one, linear_only]),
]

# the ratio the exercise asks about, printed after "correct"
test_check = check_tests(nb01, CASES, notes={nb01.check_step_macs: "t=1024"})


def test_a_loop_is_accepted(capsys):
    nb01.check_total_flops(looped)
    assert capsys.readouterr().out == "correct\n"


def test_closed_form_equals_sum():
    config = nb01.load_config("qwen3-4b")
    for p, n in nb01.CASES:
        assert nb01.total_flops_solution(config, p, n) == looped(config, p, n)
