#!/usr/bin/env bash
# The prepared device check (sync_service/bench/gpu_check.py): four lines "check N name: figure PASS|FAIL",
# exit status 1 on any FAIL. Needs torch, transformers, peft, safetensors, msgpack, xxhash; never Ray or vLLM.
#   bash scripts/gpu-check.sh                  # CUDA when present (default --size 4G), else CPU
#   bash scripts/gpu-check.sh --device cpu     # the same functions on CPU (small sizes, < 2 min)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" -m sync_service.bench.gpu_check "$@"
