"""Notebook 01's exercise checks: right for the reference, patient with a stub, helpful when wrong."""

import pytest

from conftest import stub
from exercises import nb01


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


@pytest.mark.parametrize("check,solution,wrongs", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_check(capsys, check, solution, wrongs):
    check(solution)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "correct", out
    if check is nb01.check_step_macs:  # one more line: the ratio the exercise asks about, from the configs
        assert len(out.splitlines()) == 2 and "t=1024" in out, out
    else:
        assert out == "correct\n", out
    check(stub)
    assert capsys.readouterr().out == "not attempted yet\n"
    for wrong in wrongs:
        check(wrong)
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and out not in ("correct\n", "not attempted yet\n"), out
        assert any(ch.isdigit() for ch in out), out  # names the numbers


def test_a_loop_is_accepted(capsys):
    nb01.check_total_flops(looped)
    assert capsys.readouterr().out == "correct\n"


def test_closed_form_equals_sum():
    config = nb01.load_config("qwen3-4b")
    for p, n in nb01.CASES:
        assert nb01.total_flops_solution(config, p, n) == looped(config, p, n)
