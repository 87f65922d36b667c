#!/usr/bin/env bash
# Builds the newest-versions venv (default .venv-newest): this machine's CPU torch (2.13.0 from disk) with the
# newest transformers and peft, exactly as pinned in constraints/newest.txt (re-pinned deliberately by
# scripts/refresh-newest.sh), and weightsync with its test extra. Nothing is downloaded by the tests run there.
# Exits 3, saying why, if the package index cannot be reached (the caller skips the newest-versions tests);
# any other failure is an error. Env: VENV=path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-newest}
C=constraints/newest.txt
want=$(grep -iE '^transformers==' "$C")
if ! probe=$("$PY" -m pip index versions transformers --timeout 20 --retries 1 2>&1) \
    || ! grep -q "${want#*==}" <<<"$probe"; then
  echo "newest-versions venv skipped: the package index cannot be reached (pip index versions transformers" \
       "does not list the pinned $want; its last line: $(tail -n 1 <<<"$probe"))"
  exit 3
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -c "$C" "torch==2.13.0"
"${PIP[@]}" install -q -c "$C" -e ".[test]"
"$VENV/bin/python" -c 'import peft, torch, transformers
print(f"newest-versions venv: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")'
