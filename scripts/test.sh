#!/usr/bin/env bash
# Runs the whole test suite (the README's second command).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
