#!/usr/bin/env bash
# Train with torchrun + DDP: NPROC worker processes per node; torchrun restarts the whole worker
# group after any worker failure, up to MAX_RESTARTS times, and each restart auto-resumes.
# One node:  NPROC=8 MAX_RESTARTS=3 RUN_DIR=runs/a ops/torchrun/train.sh CONFIG [harness train args]
# Several:   run on every node with NNODES=4 RDZV_ENDPOINT=head-node:29500 RDZV_ID=run-a (same on all).
# RUN_DIR must be storage every node sees (s3://..., or a shared filesystem).
set -uo pipefail

CONFIG=${1:?usage: ops/torchrun/train.sh CONFIG [extra harness train arguments]}
shift
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RUN_DIR=${RUN_DIR:-runs/torchrun}
# Seconds torchrun waits after passing a stop signal on before it SIGKILLs the workers: must
# cover one training step plus checkpoint.preempt_deadline_s (default 25 s).
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-60}

# A restarted group must not read the previous group's addresses from a shared rendezvous
# store (pytorch/pytorch#135712): each group gets its own store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

if [ "$NNODES" -gt 1 ]; then
  rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}"
              --rdzv-id "${RDZV_ID:?set RDZV_ID to the same id on every node}")
else
  rendezvous=(--standalone)
fi

# --no-python: run the `harness` console script itself in every worker. SIGUSR1 (SLURM's
# warning signal) is passed on to the workers like SIGTERM: both mean "checkpoint and stop".
torchrun "${rendezvous[@]}" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" --no-python \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  harness train "$CONFIG" --run-dir "$RUN_DIR" "$@"
rc=$?

# torchrun reports any failed worker group as its own non-zero code, so 75 (preempted: requeue)
# cannot be told from a crash here; a preempted run simply resumes when this script runs again.
if [ "$rc" -ne 0 ]; then
  echo "harness: torchrun exited $rc; run this script again to resume from the newest checkpoint" >&2
fi
exit "$rc"
