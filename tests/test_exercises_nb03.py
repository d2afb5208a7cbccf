"""Notebook 03's exercise checks: right for the reference, patient with a stub, helpful when wrong."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
from exercises import nb03  # noqa: E402


def stub(*args):
    raise NotImplementedError  # your code here


def write_by_cat(k_store, v_store, layer, start, k, v):  # rebinds a new tensor: the caller's is untouched
    k_store = torch.cat([k_store[layer, :start], k])
    v_store = torch.cat([v_store[layer, :start], v])


def write_with_clone(k_store, v_store, layer, start, k, v):  # right slots, but a copy on the way
    n = k.shape[0]
    k_store[layer, start:start + n] = k.clone()
    v_store[layer, start:start + n] = v.clone()


def write_first_slot_only(k_store, v_store, layer, start, k, v):  # a one-token write only
    k_store[layer, start] = k[0]
    v_store[layer, start] = v[0]


def max_seq_ceil(config, dtype, budget):  # rounds up: one token too many
    return nb03.max_seq_solution(config, dtype, budget) + 1


def max_seq_k_only(config, dtype, budget):  # forgets V: twice too long
    return 2 * nb03.max_seq_solution(config, dtype, budget)


CASES = [
    (nb03.check_write, nb03.write_solution, [write_by_cat, write_with_clone, write_first_slot_only]),
    (nb03.check_max_seq, nb03.max_seq_solution, [max_seq_ceil, max_seq_k_only]),
]


@pytest.mark.parametrize("check,solution,wrongs", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_check(capsys, check, solution, wrongs):
    check(solution)
    assert capsys.readouterr().out == "correct\n"
    check(stub)
    assert capsys.readouterr().out == "not attempted yet\n"
    for wrong in wrongs:
        check(wrong)
        out = capsys.readouterr().out
        assert out.strip() and out not in ("correct\n", "not attempted yet\n"), out
