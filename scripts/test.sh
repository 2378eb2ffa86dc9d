#!/usr/bin/env bash
# Set up and run the test suite: the default tier (CPU, gloo ranks on localhost, the Triton
# kernels under the interpreter). Other tiers: --tier slow | gpu | peers | all (tests/conftest.py).
# Usage: bash scripts/test.sh [pytest args], e.g. bash scripts/test.sh --tier slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
python3 -m pytest -q "$@" tests
