#!/usr/bin/env bash
# Install ds4lab into ./.venv and run the main job: the tour notebook, executed headless on
# the built-in tiny synthetic model, written to reports/01_tour.html.
#
# On Debian/Ubuntu it also installs OpenBLAS (libopenblas0-pthread), which ds4lab loads
# before MLX: MLX's Linux CPU wheel otherwise uses a reference BLAS that is ~60x slower; and
# Debian's chromium, which the browser test (tests/test_browser.py) drives through Playwright.
set -euo pipefail
cd "$(dirname "$0")"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null; then
    need=""
    ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || need="libopenblas0-pthread"
    python3 -c "import ensurepip, venv" 2>/dev/null || need="$need python3-venv"
    [ -x /usr/bin/chromium ] || need="$need chromium"
    if [ -n "$need" ]; then
        as_root apt-get update -qq && as_root apt-get install -y -qq $need >/dev/null \
            || echo "setup: could not install $need; continuing (MLX CPU matmuls will be slow without OpenBLAS;" \
                    "the browser test fails without chromium)" >&2
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/ds4lab tour --out reports
