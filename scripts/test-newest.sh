#!/usr/bin/env bash
# The suite's transformers-dependent core in the newest-versions venv (.venv-newest, constraints/newest.txt, built
# by scripts/setup-newest.sh): the families census and golden layout rows (a family whose layout or verdict moved
# is red), merges against PEFT's float64 merge_and_unload, the adapter contract, the HF engine, and every family
# synced EP=2 into a transformers engine. No vLLM, no CLI runs; nothing is downloaded. Prints its versions first.
# Extra arguments go to pytest. Env: VENV=path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-newest}
"$VENV/bin/python" -c 'import peft, torch, transformers
print(f"newest versions: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")'
tests=(
  tests/test_dependencies.py
  tests/merge/test_families_census.py tests/merge/test_golden_layouts.py tests/merge/test_families_table.py
  tests/merge/test_derive.py tests/merge/test_oracle_matrix.py tests/merge/test_peft_parity.py
  tests/merge/test_adapter_contract.py tests/engines/test_hf_engine.py tests/merge/test_sync_families.py
)
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" -k "not test_cli_syncs_family" "$@"
