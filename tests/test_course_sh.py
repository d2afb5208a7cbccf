"""./course.sh's argument handling: flags alone open JupyterLab with those flags; --help lists the
course's own commands before JupyterLab's flags."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / ".venv" / "bin" / "python").exists():
    pytest.skip("needs the course's .venv (./course.sh sets it up)", allow_module_level=True)


COMMANDS = [f"./course.sh {c}" for c in ("[open]", "test", "gpu-check", "gpu-wheels")]


def course_sh(*args, script=ROOT / "course.sh"):
    env = {**os.environ, "COURSE_SH_ECHO": "1"}
    return subprocess.run(["bash", str(script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def listed(text):
    """The course's commands in the order the text lists them, one a line."""
    lines = [line.strip() for line in text.splitlines()]
    return [c for line in lines for c in COMMANDS if line.startswith(c + " ")]


def test_flags_alone_open_jupyterlab_with_those_flags():
    run = course_sh("--no-browser", "--port", "8899")
    assert run.returncode == 0, run.stderr
    assert "jupyter lab notebooks/" in run.stdout
    assert run.stdout.rstrip().endswith("--no-browser --port 8899")


def test_open_takes_the_same_flags():
    run = course_sh("open", "--no-browser")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "--no-browser"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_course_commands_then_jupyterlabs_flags(flag):
    run = course_sh(flag)
    assert run.returncode == 0, run.stderr
    assert listed(run.stdout) == COMMANDS
    last = run.stdout.rstrip().splitlines()[-1]
    assert last.endswith("bin/jupyter lab --help")  # JupyterLab's help comes after the commands


def test_help_installs_nothing_where_there_is_no_venv(tmp_path):
    shutil.copy(ROOT / "course.sh", tmp_path)
    run = course_sh("--help", script=tmp_path / "course.sh")
    assert run.returncode == 0, run.stderr
    assert listed(run.stdout) == COMMANDS
    assert "once a first run has set up .venv/" in run.stdout
    assert not (tmp_path / ".venv").exists()


def test_an_unknown_command_names_itself_and_lists_the_commands():
    run = course_sh("tset")
    assert run.returncode == 2 and "./course.sh: no command 'tset'" in run.stderr
    assert listed(run.stderr) == COMMANDS
