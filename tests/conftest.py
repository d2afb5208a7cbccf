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


# the `exercises` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
