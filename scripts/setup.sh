#!/usr/bin/env bash
# Creates .venv at the repo root and installs weightsync with its test extras.
# torch is pinned to the CPU wheel first so no CUDA build is pulled in by a transitive range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,bench]"
echo "weightsync installed in $(pwd)/.venv"
