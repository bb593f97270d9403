#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one go, on a machine with a CUDA build of torch:
#   pip install -e '.[test]' && bash ops/gpu_check.sh [--only NAME,...] [--dry-run]
# One PASS / FAIL / SKIP line per check, then a figures block; exits 1 if any check failed. About
# 6.5 minutes on one H100 (the checks that need two GPUs say SKIP there), 10 on two: estimates, not
# yet measured (--dry-run: the plan; docs/gpu.md: what each check catches).
# CUBLAS_WORKSPACE_CONFIG is NOT set here: the harness sets it (harness/repro/numerics.py), and the
# check cublas_and_repeat runs it without one to see that it does.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [[ " $* " != *" --dry-run "* ]]; then
    python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "FAIL preflight: no CUDA device visible to torch " + torch.__version__)' || exit 1
fi
exec python ops/gpu_check.py --device cuda "$@"
