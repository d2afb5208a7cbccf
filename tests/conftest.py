"""Fixtures: SmolLM2 loaded once per session, and the notebooks' ``exercises`` package on the path.

Helpers that tests import live in ``tests/helpers.py``.
"""

import sys
from pathlib import Path

import pytest

@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, real weights, offline (first use dequantizes and caches)."""
    from kvlib import load_model

    return load_model("smollm2-135m", device="cpu")


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))  # the `exercises` package


def stub(*args):
    raise NotImplementedError  # your code here


def assert_check_behaves(capsys, check, solution, wrongs, correct="correct\n"):
    """Right for the reference, patient with a stub, and a message (not a pass) for each wrong answer."""
    check(solution)
    assert capsys.readouterr().out == correct
    check(stub)
    assert capsys.readouterr().out == "not attempted yet\n"
    for wrong in wrongs:
        check(wrong)
        out = capsys.readouterr().out
        assert out.strip() and not out.startswith("correct") and out != "not attempted yet\n", out
