#!/usr/bin/env bash
# GPU check of exact resume (issue: harness train resumes bit for bit): interrupted vs continuous
# on CUDA for several arms and precisions, and FSDP at world size 2 when 2+ GPUs are visible,
# in one go, in a few minutes. Needs a CUDA torch:
#   pip install -e . && bash ops/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible")'
exec python ops/gpu_check.py
