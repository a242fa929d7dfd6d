#!/usr/bin/env bash
# The README's install command: everything `paratrain train` and `pytest` need on a fresh
# machine, the one system package included.
#   1. headless Chromium (tests/test_report.py renders `paratrain report` pages in it):
#      installed with apt-get when no chromium is on PATH (Debian names the package
#      "chromium", older Ubuntu "chromium-browser"); elsewhere, install it yourself.
#   2. torch, only if none is installed: `torch==2.13.0` (on a machine without a GPU the
#      index or local wheel cache gives the CPU build; pyproject allows >=2.6,<2.14, so an
#      existing torch in that range is kept).
#   3. paratrain itself, editable, with the dev extra (pytest, ruff, transformers, ...).
# Uses the `python` on PATH (set PYTHON to choose another): run it inside your venv.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python}"

have_chromium() {
    command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
        || command -v google-chrome >/dev/null
}

if ! have_chromium; then
    if command -v apt-get >/dev/null; then
        sudo=""
        if [ "$(id -u)" -ne 0 ]; then
            command -v sudo >/dev/null || {
                echo "error: Chromium is missing and apt-get needs root; install the" \
                     "'chromium' package, then rerun ./install.sh" >&2
                exit 2
            }
            sudo="sudo -E"
        fi
        echo "install.sh: installing headless Chromium with apt-get (for tests/test_report.py)"
        export DEBIAN_FRONTEND=noninteractive
        $sudo apt-get update -qq
        $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null \
            || $sudo apt-get install -y -qq --no-install-recommends chromium-browser >/dev/null
    else
        echo "warning: no apt-get here; install Chromium (or Chrome) yourself for" \
             "tests/test_report.py" >&2
    fi
fi

"$PYTHON" -m pip install --upgrade pip >/dev/null
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install "torch==2.13.0"
fi
"$PYTHON" -m pip install -e ".[dev]"
# pyenv serves console scripts (paratrain, pytest) through shims made by a rehash
if command -v pyenv >/dev/null; then pyenv rehash || true; fi
echo "install.sh: done; next: paratrain train, then python -m pytest"
