"""`train.on_anomaly = "rollback"`: back to the newest good checkpoint before an anomaly, past its batches.

`roll_back(loop, anomaly)` runs on every rank at the same step (the anomaly is agreed without a
collective, harness/health/anomaly.py) and leaves the loop ready to train the step after the
checkpoint again:

1. Cap: with `train.max_rollbacks` rollbacks already within `train.rollback_window` steps, one
   more anomaly stops the run (TrainingDiverged, exit 2) with a message naming their steps.
2. Waits for the background save in flight, then rank 0 picks the newest checkpoint before the
   anomaly's step that verifies; every rank loads that one into the live parts (the same
   `load` as a resume). No checkpoint before it: the run stops, saying so.
3. The ledger keeps its skip list and history across the load and adds the step-batches
   `[batch - rollback_skip + 1, batch]` that are after the checkpoint's cursor, so the trainer
   steps over them; metrics.jsonl and the trackers are cut back to the checkpoint's step (each
   step is logged once), and the replayed steps before the anomaly are checked against the
   fingerprints logged the first time (`resume_mismatch` if they differ).
4. An `anomaly` event (action "rollback", the step, cause, value, the step rolled back to and
   the skipped step-batches) records it for `harness report` and `harness status`.

Bitwise: the replayed steps are a resume from that checkpoint, and the ledger (saved in every
later checkpoint) makes a resumed run skip the same batches; see anomaly.py.
"""

from __future__ import annotations

import copy
from typing import Any

from harness.checkpoint import load
from harness.health.anomaly import Anomaly
from harness.log import get_logger
from harness.parallel import distributed
from harness.run.elastic import after_load, fingerprint_checks
from harness.run.trainer import DIVERGED_ADVICE, TrainingDiverged

log = get_logger(__name__)


def roll_back(loop: Any, anomaly: Anomaly) -> None:
    """Roll `loop` (a `harness.run.loop.Loop`) back past `anomaly`; see the module docstring."""
    t, trainer = loop.cfg.train, loop.trainer
    ledger = trainer.counters.anomalies
    earlier = ledger.earlier_rollbacks(anomaly, t.rollback_window)
    if len(earlier) >= t.max_rollbacks:
        steps = ", ".join(str(s) for s in [*earlier, anomaly.step])
        raise TrainingDiverged(f"{anomaly.describe()}: anomalies at steps {steps} within {t.rollback_window} steps; "
                               f"stopped after {len(earlier)} rollbacks (train.max_rollbacks = {t.max_rollbacks}). "
                               f"{DIVERGED_ADVICE}")
    loop.finish_saves()
    step = distributed.on_rank0(newest_good_before, loop.store, anomaly.step)
    if step is None:
        raise TrainingDiverged(f"{anomaly.describe()}; train.on_anomaly = \"rollback\" but no good checkpoint "
                               f"before step {anomaly.step} to roll back to. {DIVERGED_ADVICE}")
    ref = loop.store.ref(step)
    before = copy.deepcopy(ledger)
    checkpoint = loop.store.open(ref)
    load(loop.store, checkpoint, trainer.state.parts(),  # rank 0 verified it
         kept_on_new_rank=trainer.state.kept_on_new_rank)
    # A checkpoint of another world size (from before an elastic resume): as a resume does.
    resized = after_load(checkpoint.state, loop.cfg, step, trainer.state.sharded,
                         shape=(trainer.batch_size, trainer.grad_accum))
    ran_past = loop.metrics.truncate_after(step) or []
    if distributed.rank() == 0:  # before the ledger changes: the restored parts match their saved hashes
        trainer.fingerprints.watch(loop.events, [r for r in ran_past if int(r["step"]) < anomaly.step],
                                   **fingerprint_checks(resized))
    ledger.keep_after_reload(before)
    consumed = ledger.next_batch(step) - 1  # the last step-batch before the checkpoint's cursor
    skip = [b for b in range(anomaly.batch - t.rollback_skip + 1, anomaly.batch + 1) if b > consumed]
    entry = ledger.record_rollback(anomaly, step, skip)
    loop.rolled_back(step)
    log.warning("anomaly: rolled back to the newest good checkpoint before it, skipping its batches",
                anomaly=anomaly.describe(), to_step=step, skip=skip)
    loop.events.emit("anomaly", action="rollback", rollbacks=len(ledger.history), **entry)


def newest_good_before(store: Any, step: int) -> int | None:
    """The step of the newest checkpoint before `step` that verifies, or None."""
    ref = store.first_good([r for r in store.candidates() if r.step < step])
    return None if ref is None else ref.step
