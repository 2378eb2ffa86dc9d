#!/usr/bin/env bash
# The suite on the oldest dependencies setup.py declares (tests/oldest-requirements.txt), in a
# virtual environment of its own (.venv-oldest): the slow tier's dependency job. It downloads
# torch 2.11 with its CUDA libraries (several GB; they run on CPU too).
# Usage: bash scripts/test_oldest.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-oldest
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "setuptools>=70.1" -r tests/oldest-requirements.txt
"$venv/bin/python" -m pip install -q --no-build-isolation -e ".[test]" -c tests/oldest-requirements.txt
"$venv/bin/python" -m pytest -q "$@" tests
