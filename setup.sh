#!/usr/bin/env bash
# The one set-up command: poise-trl (editable), TRL 1.16, the test tools and the task families' packages,
# into the environment of `python3` (an active venv's, or the system's; PYTHON=/path/to/python picks another).
# A script rather than a Makefile: it needs only bash and pip (slim images and a fresh macOS have no `make`).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}

# torch first, pinned to the version CI tests. PyPI's Linux wheels bundle CUDA (GBs); on a CPU-only machine
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash setup.sh takes the CPU build instead.
"$python" -m pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$python" -m pip install -e ".[dev,tasks]"
# BFCL's question files and IFEval's checkers, without their dependency sets (dozens of packages the task
# code never imports). `pip check` therefore lists their unmet requirements: docs/getting-started.md says
# why that is harmless.
"$python" -m pip install --no-deps bfcl-eval==2026.3.23 lm-eval==0.4.13
echo "poise-trl is set up in $("$python" -c 'import sys; print(sys.prefix)'); next: poise train recipes/toy/poise.yaml"
