#!/usr/bin/env bash
# The prepared device check (sync_service/bench/gpu_check.py): four lines "check N name: figure PASS|FAIL",
# each printed as its check finishes, exit status 1 on any FAIL. Needs torch, transformers, peft, safetensors,
# msgpack, xxhash (what the device machine's image has); never Ray or vLLM, and it installs nothing.
# Each check runs in its own process under --check-timeout seconds (default 180; a hung check is killed, a FAIL).
#   bash scripts/gpu-check.sh                        # CUDA when present (default --size 4G), else CPU
#   bash scripts/gpu-check.sh --device cpu           # the same functions on CPU (small sizes, ~1-2 min)
#   bash scripts/gpu-check.sh --checks 2,1           # some checks, in this order (default 1,2,4,3: slowest last)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" -m sync_service.bench.gpu_check "$@"
