"""./course.sh's argument handling: flags alone open JupyterLab with those flags."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / ".venv" / "bin" / "python").exists():
    pytest.skip("needs the course's .venv (./course.sh sets it up)", allow_module_level=True)


def course_sh(*args):
    env = {**os.environ, "COURSE_SH_ECHO": "1"}
    return subprocess.run(["bash", str(ROOT / "course.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_flags_alone_open_jupyterlab_with_those_flags():
    run = course_sh("--no-browser", "--port", "8899")
    assert run.returncode == 0, run.stderr
    assert "jupyter lab notebooks/" in run.stdout
    assert run.stdout.rstrip().endswith("--no-browser --port 8899")


def test_open_takes_the_same_flags():
    run = course_sh("open", "--no-browser")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "--no-browser"


def test_an_unknown_command_prints_the_usage():
    run = course_sh("tset")
    assert run.returncode == 2 and "usage: ./course.sh" in run.stderr
