#!/usr/bin/env bash
# Train on one node with torchrun: NPROC worker processes; torchrun restarts the whole worker
# group after any worker failure, up to MAX_RESTARTS times, and each restart auto-resumes.
# Usage: NPROC=8 MAX_RESTARTS=3 RUN_DIR=runs/a ops/torchrun/train.sh CONFIG [harness train args]
set -uo pipefail

CONFIG=${1:?usage: ops/torchrun/train.sh CONFIG [extra harness train arguments]}
shift
NPROC=${NPROC:-1}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RUN_DIR=${RUN_DIR:-runs/torchrun}

# --no-python: run the `harness` console script itself in every worker.
torchrun --standalone --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" --no-python \
  harness train "$CONFIG" --run-dir "$RUN_DIR" "$@"
rc=$?

# torchrun reports any failed worker group as its own non-zero code, so 75 (preempted: requeue)
# cannot be told from a crash here; a preempted run simply resumes when this script runs again.
if [ "$rc" -ne 0 ]; then
  echo "harness: torchrun exited $rc; run this script again to resume from the newest checkpoint" >&2
fi
exit "$rc"
