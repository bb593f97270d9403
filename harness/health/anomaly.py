"""Anomalies (a NaN/inf loss or gradient norm, a loss spike) and the ledger that makes rollbacks resumable.

Detection (`detect`) runs in the trainer after the loss is all-reduced and DDP has all-reduced the
gradients, before the optimizer step: every rank sees the same mean loss and the same gradient
norm, so every rank calls the same anomaly at the same step without a collective of its own.
A spike is a loss above `median + threshold x 1.4826 x MAD` of the last `window` finite losses
(the MAD scaled to a standard deviation of normal noise; median and MAD are not moved by the
spikes they are meant to find), called only once half the window is seen.

Batches are counted in *step-batches*: the micro-batches of one optimizer step. Step-batch `b`
is the b-th such group the data stream delivers; without skips step `n` trains on step-batch
`n`. A rollback (harness/run/rollback.py) adds the step-batches that caused an anomaly to
`AnomalyLedger.skip`; the trainer then draws and discards them when it meets them again, so
the run goes on with the batches after them.

The ledger is part of the trainer's checkpointed counters (`state.TrainerCounters`): the skip
list and the history of rollbacks only grow, and a rollback keeps them across the reload, so a
run killed after a rollback and resumed from an older checkpoint skips the same batches and
records the same history: it ends bitwise equal to the run that was not killed. A run killed
between the anomaly and the next checkpoint meets the anomaly again, rolls back the same way and
records the same entry (entries are kept once). `recent` (the spike window) is restored from the
checkpoint, as the step's data cursor is: it describes the steps up to it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Anomaly:
    """What was wrong at `step` (the step that was not applied), trained on step-batch `batch`."""

    step: int
    batch: int
    cause: str  # "nonfinite_loss" | "nonfinite_grad" | "loss_spike"
    value: float
    threshold: float | None = None

    def describe(self) -> str:
        if self.cause == "loss_spike":
            return f"loss {self.value:.6g} is a spike (threshold {self.threshold:.6g}) at step {self.step}"
        if self.cause == "nonfinite_loss":
            return f"loss is {self.value} at step {self.step}"
        return f"gradient norm is {self.value} at step {self.step}"


class AnomalyLedger:
    """Skipped step-batches, the rollback history and the recent losses (module docstring)."""

    def __init__(self) -> None:
        self.skip: set[int] = set()
        self.skipped = 0  # step-batches drawn and discarded so far (they are before the cursor)
        self.history: list[dict[str, Any]] = []
        self.recent: list[float] = []

    def next_batch(self, step: int) -> int:
        """The step-batch that step `step + 1` draws next, before skipping."""
        return step + 1 + self.skipped

    def observe(self, loss: float, window: int) -> None:
        """A step was applied with this loss: it joins the spike window."""
        self.recent.append(loss)
        del self.recent[:-window]

    def spike_threshold(self, threshold: float, window: int) -> float | None:
        if len(self.recent) < max(window // 2, 4):
            return None
        median = statistics.median(self.recent)
        mad = statistics.median(abs(x - median) for x in self.recent)
        return median + threshold * MAD_TO_SIGMA * mad

    def earlier_rollbacks(self, anomaly: Anomaly, window: int) -> list[int]:
        """Steps of the rollbacks in (step - window, step] other than one for this very anomaly
        (met again by a run resumed from before it)."""
        return [int(h["step"]) for h in self.history if anomaly.step - window < int(h["step"]) <= anomaly.step
                and not (h["step"] == anomaly.step and h["batch"] == anomaly.batch)]

    def record_rollback(self, anomaly: Anomaly, to_step: int, skip: list[int]) -> dict[str, Any]:
        # JSON has no NaN/inf: a non-finite value is kept as its name, so entries compare equal.
        entry = {**asdict(anomaly), "value": anomaly.value if math.isfinite(anomaly.value) else str(anomaly.value),
                 "to_step": to_step, "skip": skip}
        if entry not in self.history:
            self.history.append(entry)
        self.skip.update(skip)
        return entry

    def keep_after_reload(self, before: AnomalyLedger) -> None:
        """After loading an older checkpoint into this ledger: keep what only grows (the skip
        list and history of `before`, the ledger as it was before the load)."""
        self.skip |= before.skip
        self.history = before.history + [h for h in self.history if h not in before.history]

    def state_dict(self) -> dict[str, Any]:
        return {"skip": sorted(self.skip), "skipped": self.skipped, "history": self.history, "recent": self.recent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skip = {int(b) for b in state.get("skip", [])}
        self.skipped = int(state.get("skipped", 0))
        self.history = [dict(h) for h in state.get("history", [])]
        self.recent = [float(x) for x in state.get("recent", [])]

    def __bool__(self) -> bool:
        """Whether there is anything to save (a run that never had one keeps its old state dict)."""
        return bool(self.skip or self.skipped or self.history or self.recent)


def detect(ledger: AnomalyLedger, step: int, batch: int, loss: float, grad_norm: float, *, grads_checked: bool,
           spike_threshold: float | None, spike_window: int) -> Anomaly | None:
    """The anomaly of step `step` (not yet applied), or None. `grads_checked`: whether a
    non-finite gradient norm counts (with fp16 the grad scaler owns those: it skips the step)."""
    if not math.isfinite(loss):
        return Anomaly(step, batch, "nonfinite_loss", loss)
    if grads_checked and not math.isfinite(grad_norm):
        return Anomaly(step, batch, "nonfinite_grad", grad_norm)
    if spike_threshold is not None:
        limit = ledger.spike_threshold(spike_threshold, spike_window)
        if limit is not None and loss > limit:
            return Anomaly(step, batch, "loss_spike", loss, limit)
    return None
