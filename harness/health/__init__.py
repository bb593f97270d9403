"""Long-job health: what keeps a long run from wasting its allocation without crashing.

- `watchdog.HangWatchdog`: a step, save or collective that takes far longer than the usual step
  dumps every thread's stack and exits HUNG (79), so a supervisor or launcher restarts the job.
- `anomaly`: non-finite and loss-spike detection (`train.on_anomaly`) and the ledger of skipped
  batches that checkpoints carry (the rollback itself is the run's: harness/run/rollback.py).
- `trackers`: TensorBoard (rank 0, metrics.jsonl stays the source of truth).
- `run_status`: `harness status RUN_DIR`.
- `debug_hooks`: the debug hooks that make a run hang or poison a batch, for the tests of the above.
"""
