#!/usr/bin/env bash
# Train with torchrun + DDP: NPROC worker processes per node; torchrun restarts the whole worker
# group after any worker failure, up to MAX_RESTARTS times, and each restart auto-resumes; after
# exit 2 or 3 (a user error, a supervisor that gave up) a restarted trainer exits with the same
# code at once (harness/exit_codes.py: earlier_stop), so nothing is trained or printed again.
# One node:  NPROC=8 MAX_RESTARTS=3 RUN_DIR=runs/a ops/torchrun/train.sh CONFIG [harness train args]
# Several:   run on every node with NNODES=4 RDZV_ENDPOINT=head-node:PORT RDZV_ID=run-a (same on all).
# Elastic:   NNODES=2:4 (MIN:MAX nodes), with RDZV_CONF=is_host=false and RDZV_ENDPOINT a rendezvous
#            store that no node hosts (ops/torchrun/rendezvous_store.py).
# RUN_DIR must be storage every node sees (s3://..., or a shared filesystem).
#
# Exit code: the trainers' own when torchrun cannot pass it on (it reports any failed worker
# group as its exit 1): 75/76 when every trainer of this node stopped at a checkpoint, 69 when one
# found the storage unavailable (after UNAVAILABLE_RETRIES retries here, with backoff), 79 when
# one hung (its watchdog dumped the stacks; torchrun's own restarts are spent), 2 on a user
# error, 3 when one gave up; otherwise torchrun's. See ops/README.md.
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
# Storage outages (exit 69): retries in this script, and the first backoff (it doubles).
UNAVAILABLE_RETRIES=${UNAVAILABLE_RETRIES:-3}
UNAVAILABLE_BACKOFF_S=${UNAVAILABLE_BACKOFF_S:-30}

# A restarted group must not read the previous group's addresses from a shared rendezvous
# store (pytorch/pytorch#135712): each group gets its own store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# NCCL's flight recorder: the last collectives of every rank, dumped by the hang watchdog
# (harness/health/watchdog.py, into the log dir) and by NCCL's own timeout (to the file below).
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-${TMPDIR:-/tmp}/harness-nccl-trace-rank-}
# Every trainer writes its exit code here (harness/exit_codes.py: record).
HARNESS_EXIT_CODE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/harness-exit.XXXXXX")
export HARNESS_EXIT_CODE_DIR
trap 'rm -rf "$HARNESS_EXIT_CODE_DIR"' EXIT

# NNODES=MIN:MAX is an elastic group: torchrun starts once MIN nodes joined, admits up to MAX, and
# after a node is lost (or one joins) restarts the workers at the new world size, which resume
# with the global batch kept (docs/distributed.md, "Changing the world size"). RDZV_CONF passes
# --rdzv-conf, e.g. is_host=false when the endpoint is a store of its own
# (ops/torchrun/rendezvous_store.py) that outlives any node.
if [ "$NNODES" != 1 ]; then
  rendezvous=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}"
              --rdzv-id "${RDZV_ID:?set RDZV_ID to the same id on every node}")
  [ -n "${RDZV_CONF:-}" ] && rendezvous+=(--rdzv-conf "$RDZV_CONF")
else
  rendezvous=(--standalone)
fi

# A stop signal to this script (SLURM's warning USR1 reaches exactly this shell; bash would die
# of it by default) goes to torchrun's process group; torchrun passes it on to every worker,
# which saves at the next step boundary and exits 75, then torchrun waits up to SHUTDOWN_TIMEOUT.
torchrun_pid=""
stop_requested=0
forward() {
  stop_requested=1
  echo "harness: received SIG$1; passing it to torchrun and its trainers" >&2
  [ -n "$torchrun_pid" ] && kill -s "$1" -- "-$torchrun_pid" 2>/dev/null
}
for sig in TERM USR1 INT; do
  trap "forward $sig" "$sig"
done

# The codes the trainers of the last worker group attempt recorded (one file per rank).
trainer_codes() {
  local last
  last=$(ls "$HARNESS_EXIT_CODE_DIR" | sed -n 's/^restart-\([0-9]*\)\.rank-.*/\1/p' | sort -n | tail -n 1)
  [ -n "$last" ] && cat "$HARNESS_EXIT_CODE_DIR"/restart-"$last".rank-*
}

# One torchrun; sets rc to the trainers' exit code where torchrun's own says only "failed".
run_group() {
  rm -f "$HARNESS_EXIT_CODE_DIR"/*
  # --no-python: run the `harness` console script itself in every worker. `set -m` gives torchrun
  # its own process group (the target of `forward`); SIGUSR1 reaches the workers like SIGTERM.
  set -m
  torchrun "${rendezvous[@]}" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" --no-python \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
    harness train "$CONFIG" --run-dir "$RUN_DIR" "$@" &
  torchrun_pid=$!
  set +m
  # `wait` returns early when a trap runs; keep waiting until torchrun has really exited.
  wait "$torchrun_pid"
  rc=$?
  while kill -0 "$torchrun_pid" 2>/dev/null; do
    wait "$torchrun_pid"
    rc=$?
  done
  torchrun_pid=""
  [ "$rc" -eq 0 ] && return
  local codes count
  codes=$(trainer_codes | sort -u | tr '\n' ' ')
  count=$(trainer_codes | wc -l)
  case " $codes" in
    *" 2 "*) rc=2 ;;    # a user error: retrying cannot help
    *" 3 "*) rc=3 ;;    # a supervisor gave up on a crash loop: retrying cannot help either
    *" 69 "*) rc=69 ;;  # storage unavailable: retry after a backoff
    *" 79 "*) rc=79 ;;  # a trainer hung: the launcher above may requeue (elsewhere)
    " 75 " | " 76 " | " 75 76 ")
      # every trainer of this node stopped at a checkpoint (76 if one missed its deadline)
      [ "$count" -eq "$NPROC" ] && rc=$(echo "$codes" | tr ' ' '\n' | sort -n | tail -n 1) ;;
  esac
  echo "harness: torchrun exited, trainers' exit codes: ${codes:-none recorded}; exit $rc" >&2
}

# Storage outages (exit 69) are retried here after a doubling backoff; still 69 after
# UNAVAILABLE_RETRIES, the script exits 69 for the launcher above (SLURM requeues it).
attempt=0
while true; do
  run_group "$@"
  [ "$rc" -eq 69 ] && [ "$stop_requested" -eq 0 ] && [ "$attempt" -lt "$UNAVAILABLE_RETRIES" ] || break
  backoff=$((UNAVAILABLE_BACKOFF_S << attempt))
  attempt=$((attempt + 1))
  echo "harness: storage unavailable; retry $attempt of $UNAVAILABLE_RETRIES in ${backoff}s" >&2
  sleep "$backoff" &
  wait $!  # a stop signal ends the backoff at once
  if [ "$stop_requested" -eq 1 ]; then
    rc=75  # nothing is running and the storage holds the newest good checkpoint: requeue
    break
  fi
done
exit "$rc"
