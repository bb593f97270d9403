"""The learning-rate schedule every arm uses, and what it does when a resumed run changes it.

A `Schedule` is a multiplier on each parameter group's peak lr: linear warmup, then a decay
curve over the post-warmup progress p = min(1, (s - warmup) / max(1, total_steps - warmup)) at
scheduler step s (0-based, as torch's schedulers count):
    (s + 1) / max(warmup, 1)                                       for s < warmup
    cosine:  r + (1 - r) * (1 + cos(pi * p)) / 2                   (the team's reference)
    linear:  1 - (1 - r) * p
    wsd:     1 while p <= 1 - decay_fraction, then linear to r     (warmup-stable-decay)
with r = lr_min_ratio; `total_steps == 0` is constant after warmup (the reference's legacy mode).

Changing the schedule on resume (`train.steps` 20 -> 30, another `schedule`, `lr_min_ratio`,
...) must not make the lr jump. The rule (`replan`): when the new schedule at the resumed step
s0 already gives the multiplier m0 the old one gave there (no change; WSD extended in its stable
phase), it is used as is. Otherwise the rest of the run follows the new curve from the point p0
where it equals m0, stretched to end at the new total: p(s) = p0 + (1 - p0) * (s - s0) / (T - s0).
Why re-stretch rather than a constant tail: it also covers a mid-run extension or cut (the decay
is spread over the steps that are left) and a changed shape, and for a finished cosine run
(m0 = r, so p0 = 1) it *is* the constant tail at the minimum lr. Exceptions, both deliberate
changes of the ramp: a resume inside the new warmup follows the new warmup, and a constant
schedule (total_steps 0, or lr_min_ratio 1) is constant after warmup whatever came before. A
changed peak lr is not a schedule change: the multiplier continues and scales the new lr.
The anchor (s0, p0) is scheduler state, saved in the checkpoint, so later resumes replay it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from optim.tree import Changes, plain, same

Kind = Literal["cosine", "linear", "wsd"]


@dataclass(frozen=True)
class Schedule:
    """The multiplier of `kind` with `warmup` steps over `total_steps` (0 = constant after
    warmup), ending at `lr_min_ratio`; `decay_fraction` is WSD's share of the post-warmup steps
    spent decaying (ignored by the other kinds)."""

    kind: Kind = "cosine"
    warmup: int = 0
    total_steps: int = 0
    lr_min_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in ("cosine", "linear", "wsd"):
            raise ValueError(f"unknown schedule kind {self.kind!r}")

    def multiplier(self, step: int, anchor: Anchor | None = None) -> float:
        """The multiplier at scheduler step `step`; from `anchor.step` on, along the re-planned
        progress of `anchor` (see `replan`)."""
        if step < self.warmup:
            return (step + 1) / max(self.warmup, 1)
        if self.constant():
            return 1.0
        if anchor is not None and step >= anchor.step:
            progress = anchor.progress + (1 - anchor.progress) * min(
                1.0, (step - anchor.step) / max(1, self.total_steps - anchor.step))
        else:
            progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.curve(progress)

    def constant(self) -> bool:
        """True when the multiplier stays 1 after warmup (no decay to plan)."""
        return self.total_steps <= 0 or self.lr_min_ratio >= 1.0

    def curve(self, p: float) -> float:
        """The post-warmup multiplier at progress p in [0, 1]: 1 at 0, lr_min_ratio at 1."""
        r = self.lr_min_ratio
        if self.kind == "cosine":
            return r + 0.5 * (1 - r) * (1 + math.cos(math.pi * p))
        if self.kind == "linear":
            return 1 - (1 - r) * p
        stable = 1 - self.decay_fraction
        return 1.0 if p <= stable else 1 - (1 - r) * (p - stable) / self.decay_fraction

    def progress_at(self, m: float) -> float:
        """The latest progress where `curve` equals m (clamped to [0, 1]): where a re-planned
        schedule picks up a multiplier m. Not for a constant schedule."""
        r = self.lr_min_ratio
        x = min(1.0, max(0.0, (m - r) / (1 - r)))  # 1 at the peak, 0 at the minimum
        if self.kind == "cosine":
            return math.acos(2 * x - 1) / math.pi
        if self.kind == "linear":
            return 1 - x
        return 1 - self.decay_fraction * x


@dataclass(frozen=True)
class Anchor:
    """From scheduler step `step` on, the progress runs from `progress` to 1 at total_steps."""

    step: int
    progress: float


def replan(old: Schedule, anchor: Anchor | None, step: int, new: Schedule) -> Anchor | None:
    """The anchor under which `new` continues a run that followed `old` (with `anchor`) up to
    scheduler step `step` (the module docstring's rule)."""
    if new == old:
        return anchor
    if step < new.warmup or new.constant():
        return None
    m0 = old.multiplier(step, anchor)
    if new.multiplier(step) == m0:
        return None
    return Anchor(step, new.progress_at(m0))


class ScheduledLR(torch.optim.lr_scheduler.LRScheduler):
    """`lr = peak lr of the group * schedule.multiplier(step)` for every group of `optimizer`.

    The schedule and the peak lrs come from the config, never from a checkpoint: `state_dict`
    holds the step counters, the schedule that was followed and its anchor; `load_state_dict`
    takes the counters, re-plans from the saved schedule to this one (`replan`) and sets every
    group's lr for the restored step from this run's peak lrs. Loading a state saved under the
    same schedule and peak lrs restores the lrs bitwise. After a load, `hyperparameter_changes`
    holds what it did not take as saved ("base_lrs", "schedule" -> (saved, built)), `notes` a
    state from before schedules were saved ("schedule not recorded": it followed this one), and
    `restored_with_changes` the names of both; `replanned` describes the last re-plan (None when
    the schedule was kept).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule):
        self.schedule = schedule
        self.anchor: Anchor | None = None
        self.replanned: dict[str, Any] | None = None
        self.hyperparameter_changes: Changes = {}
        self.notes: list[str] = []
        super().__init__(optimizer)

    @property
    def restored_with_changes(self) -> list[str]:
        return sorted(self.hyperparameter_changes) + self.notes

    def get_lr(self) -> list[float | torch.Tensor]:  # torch's type: a base lr may be a tensor
        m = self.schedule.multiplier(self.last_epoch, self.anchor)
        return [base * m for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count,
                "base_lrs": list(self.base_lrs), "_last_lr": list(self._last_lr),
                "schedule": asdict(self.schedule),
                "anchor": None if self.anchor is None else asdict(self.anchor)}

    @staticmethod
    def parse(state_dict: dict[str, Any]) -> tuple[int, int, Schedule | None, Anchor | None]:
        """(step, step count, the schedule followed or None, its anchor) of a saved state.
        Raises KeyError, TypeError or ValueError when it is malformed; changes nothing."""
        saved, anchor = state_dict.get("schedule"), state_dict.get("anchor")
        return (int(state_dict["last_epoch"]), int(state_dict["_step_count"]),
                Schedule(**saved) if saved is not None else None,
                Anchor(**anchor) if anchor is not None else None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step, step_count, recorded, saved_anchor = self.parse(state_dict)
        # A state without a schedule was written before schedules were saved: it followed this one.
        old = recorded or self.schedule
        self.hyperparameter_changes = {}
        if not same(state_dict.get("base_lrs"), self.base_lrs):
            self.hyperparameter_changes["base_lrs"] = (state_dict.get("base_lrs"), plain(self.base_lrs, "base_lrs"))
        if old != self.schedule:
            self.hyperparameter_changes["schedule"] = (asdict(old), asdict(self.schedule))
        self.notes = ["schedule not recorded"] if recorded is None else []
        self.anchor = replan(old, saved_anchor, step, self.schedule)
        self.replanned = None if old == self.schedule else {
            "step": step, "from": asdict(old), "to": asdict(self.schedule),
            "multiplier": self.schedule.multiplier(step, self.anchor),
            "anchor": None if self.anchor is None else asdict(self.anchor)}
        self.last_epoch, self._step_count = step, step_count
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
