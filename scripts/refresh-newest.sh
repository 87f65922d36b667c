#!/usr/bin/env bash
# Re-pins constraints/newest.txt to the newest transformers and peft on the package index, with everything
# they and weightsync's core + test extra resolve to, over this machine's CPU torch (2.13.0 from disk).
# Run it deliberately (CI stays deterministic between refreshes):
#   bash scripts/refresh-newest.sh
# then rebuild the venv and rewrite what the versions show, and commit all of it:
#   bash scripts/setup-newest.sh
#   .venv-newest/bin/python -m tests.merge.families_census --write   (the README census, its newest column)
#   bash scripts/test-newest.sh                                      (red: a family whose layout moved)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
PIP=("$tmp/venv/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q -e ".[test]" transformers peft
{
  echo "# The newest transformers and peft on the index with what they resolve to, over the CPU torch on disk:"
  echo "# written by scripts/refresh-newest.sh on $(date -u +%Y-%m-%d); scripts/setup-newest.sh installs exactly this."
  "${PIP[@]}" freeze --exclude-editable | grep -iv '^weightsync'
} > constraints/newest.txt
grep -iE '^(torch|transformers|peft)==' constraints/newest.txt
