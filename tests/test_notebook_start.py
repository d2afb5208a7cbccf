"""What a learner meets as a notebook opens. Its kernelspec is the one JupyterLab writes, so that
opening it marks nothing unsaved (tests/browser_check.py shows it in a browser). Its first code
cell, the Colab install cell: one text in every notebook, no invented address, and what it does on
Colab (clone COURSE_REPO, or stop and say what to set) and elsewhere (nothing). The cell's IPython
lines (!git, %pip, %cd) go to a recording stand-in for the shell."""

import json
import os
import re
import sys
import types
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.utils.text import DollarFormatter

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("**/*.ipynb"))
NOTEBOOKS = [p for p in NOTEBOOKS if ".ipynb_checkpoints" not in p.parts]
CLONE = "/content/kv-cache-course"
NO_CLONE_HERE = pytest.mark.skipif(os.path.isdir(CLONE), reason=f"{CLONE} exists: no clone to see")


def first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


CELL = first_code_cell(NOTEBOOKS[0])


class Shell:
    """What get_ipython() answers for the cell: each shell command and magic, expanded as IPython
    expands them (``{name}`` from the cell's own variables), recorded instead of run."""

    def __init__(self, namespace):
        self.namespace, self.calls = namespace, []

    def system(self, command):
        self.calls.append(("!", DollarFormatter().vformat(command, [], self.namespace)))

    def run_line_magic(self, name, line, _stack_depth=1):
        self.calls.append((name, DollarFormatter().vformat(line, [], self.namespace)))


def run_cell(monkeypatch, colab: bool, repo: str | None) -> Shell:
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    if repo is None:
        monkeypatch.delenv("COURSE_REPO", raising=False)
    else:
        monkeypatch.setenv("COURSE_REPO", repo)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cell prepends the clone's folders
    namespace = {}
    shell = Shell(namespace)
    namespace["get_ipython"] = lambda: shell
    exec(TransformerManager().transform_cell(CELL), namespace)
    return shell


def test_every_notebook_names_the_kernel_as_jupyterlab_does():
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    spec = kernelspec.KernelSpecManager().get_kernel_spec("python3")  # the kernel JupyterLab starts
    written = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}
    rewritten = [p.name for p in NOTEBOOKS
                 if json.loads(p.read_text())["metadata"]["kernelspec"] != written]
    assert not rewritten, f"JupyterLab would rewrite the kernelspec to {written} in {rewritten}"


def test_every_notebook_starts_with_the_same_install_cell():
    assert len(NOTEBOOKS) == 11  # 00-09 and the deep dive
    different = [p.name for p in NOTEBOOKS if first_code_cell(p) != CELL]
    assert not different, f"first code cell differs from {NOTEBOOKS[0].name}'s in {different}"


def test_the_cell_names_no_repository_of_its_own():
    addresses = re.findall(r"https?://\S+", CELL)
    assert addresses and all("<" in a for a in addresses), addresses  # placeholders only


def test_outside_colab_it_does_nothing(monkeypatch):
    cwd = os.getcwd()
    assert run_cell(monkeypatch, colab=False, repo="https://example.org/fork").calls == []
    assert os.getcwd() == cwd


@NO_CLONE_HERE
def test_on_colab_without_course_repo_it_stops_and_says_what_to_set(monkeypatch):
    with pytest.raises(RuntimeError) as err:
        run_cell(monkeypatch, colab=True, repo=None)
    message = str(err.value)
    assert ('the repository this notebook was opened from: '
            'os.environ["COURSE_REPO"] = "https://github.com/<you>/<fork>"') in message


@NO_CLONE_HERE
def test_on_colab_it_clones_course_repo_installs_it_and_moves_into_notebooks(monkeypatch):
    repo = "https://github.com/someone/a-fork"
    calls = run_cell(monkeypatch, colab=True, repo=repo).calls
    assert calls[0] == ("!", f"git clone -q --depth 1 {repo} {CLONE}")
    assert [name for name, _ in calls] == ["!", "pip", "pip", "cd"]
    assert calls[1][1].startswith(f"install -q -e {CLONE} ")
    assert calls[-1] == ("cd", f"{CLONE}/notebooks")
