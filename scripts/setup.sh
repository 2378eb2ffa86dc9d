#!/usr/bin/env bash
# Install megadomino (editable) and its dependencies. torch is installed first and explicitly so
# that pip never swaps an existing torch (GPU machines bring their own) for another build.
# Usage: bash scripts/setup.sh [extras], e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
# --no-build-isolation builds with this environment's setuptools (the GPU machines are offline):
# a fresh Python 3.12+ venv has none, and before 70.1 an editable build also needs `wheel`.
python3 -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" 2>/dev/null \
  || python3 -m pip install -q "setuptools>=70.1"
extras=${1:-}
target="."
[ -n "$extras" ] && target=".[$extras]"
python3 -m pip install -q --no-build-isolation -e "$target"
