"""Helpers the tests import by name (conftest.py keeps fixtures and pytest's own setup).

The exercise checks' contract: every ``check_*`` of a notebook's ``exercises`` module is fed its
reference solution, a stub and known wrong answers, and must print one verdict for each.
"""

import pytest


def stub(*args):
    raise NotImplementedError  # your code here


def assert_check_behaves(capsys, check, solution, wrongs, note=None):
    """Right for the reference, patient with a stub, one line naming numbers for a wrong answer.

    ``note``: text the line after ``correct`` holds, for a check that prints one; otherwise the
    reference must get exactly ``correct``.
    """
    check(solution)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:1] == ["correct"], lines
    assert len(lines) == (1 if note is None else 2), lines
    assert note is None or note in lines[1], lines
    check(stub)
    assert capsys.readouterr().out == "not attempted yet\n"
    assert wrongs, "a check is meta-tested with at least one wrong answer"
    for wrong in wrongs:
        check(wrong)
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out  # one line
        assert out not in ("correct\n", "not attempted yet\n"), out
        assert any(ch.isdigit() for ch in out), out  # names the numbers


def check_tests(module, cases, notes=None):
    """One test per ``check_*`` of ``module``: assign it to a ``test_`` name to collect it.

    ``cases``: ``(check, solution, wrong answers)`` rows; ``notes``: by check, text of the line
    it prints after ``correct``, for the checks that print one. A check with no row fails its
    test, so a new exercise cannot ship untested.
    """
    rows = {check.__name__: (check, solution, wrongs) for check, solution, wrongs in cases}
    notes = notes or {}

    @pytest.mark.parametrize("name", [name for name in vars(module) if name.startswith("check_")])
    def test_check(capsys, name):
        assert name in rows, f"{module.__name__}.{name} has no meta-test: add a row to CASES"
        check, solution, wrongs = rows[name]
        assert_check_behaves(capsys, check, solution, wrongs, note=notes.get(check))

    return test_check
