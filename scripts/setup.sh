#!/usr/bin/env bash
# Install megadomino (editable) and its dependencies. torch is installed first and explicitly so
# that pip never swaps an existing torch (GPU machines bring their own) for another build.
# Usage: bash scripts/setup.sh [extras], e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
extras=${1:-}
target="."
[ -n "$extras" ] && target=".[$extras]"
python3 -m pip install -q --no-build-isolation -e "$target"
