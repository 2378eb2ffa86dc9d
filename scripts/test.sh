#!/usr/bin/env bash
# Set up and run the test suite (CPU: gloo ranks on localhost; tests/gpu is skipped without CUDA).
# Usage: bash scripts/test.sh [pytest args]   (slow tier: bash scripts/test.sh -m slow)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
python3 -m pytest -q "$@" tests
