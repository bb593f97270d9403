#!/usr/bin/env bash
# GPU checks, in one go, needing a CUDA torch:
#   pip install -e '.[test]' && bash ops/gpu_check.sh [resume|scale]
# resume: exact resume on CUDA, interrupted vs continuous for several arms and precisions, and FSDP at
#   world size 2 when 2+ GPUs are visible (ops/gpu_check.py; a few minutes).
# scale: background saves of GPU state (issue #58: the staging ring pinned, device-to-host copies on a
#   side stream): the saver's CUDA tests, then ops/bench/scale.py --device cuda at 0.5, 2 and 4 GiB
#   (blocking until the copy is done on the device vs torch copies into pinned memory, persist vs raw
#   write + fsync, a GPU training step during a save, RSS, restore; docs/bench-scale.md). About 6 minutes.
# Both without an argument; exits non-zero if either fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible")' || exit 1
what="${1:-all}"
status=0
if [[ $what == all || $what == resume ]]; then
    python ops/gpu_check.py || status=1
fi
if [[ $what == all || $what == scale ]]; then
    python -m pytest -q -p no:cacheprovider tests/checkpoint/save/test_async_save.py -k gpu || status=1
    python ops/bench/scale.py --device cuda --sizes 0.5,2,4 --rounds 2 || status=1
fi
exit $status
