"""MultiSched: named LR schedulers as one resumable part, and what its load takes from a checkpoint.

State dict: {opt_name: scheduler.state_dict()} (plain trees, optim/tree.py).

A scheduler's state mixes its progress (the step counters, the lrs it last set, a warm restart's
position) with its settings (torch's `base_lrs`, `T_max`, `step_size`, `gamma`, `milestones`, a
callable lr_lambda's attributes; ours: the peak lrs and the schedule). A load takes the progress
from the checkpoint and the settings from the scheduler as built (the config, the task's code):
torch's own `load_state_dict` puts the saved settings back, which silently undid a changed lr.
Each setting that differs is named with both values (`hyperparameter_changes`, for the harness to
refuse or record), and so is the lr a LambdaLR's lambdas give at the restored step when only
their code changed (a function saves nothing: its effect is compared).

When anything differs, a torch scheduler resumes as the one built would be at the restored step:
a copy of it as built (taken when the bundle is made, over a stand-in of its optimizer's groups)
is stepped as many times as the saved one was, and its state and the values it set in the groups
(the lr, a cycled momentum) are loaded, so the change lands at the first resumed step, as if the
run had had it from the start (a StepLR with a new step_size is where that step_size puts it).
Stepping is cheap (about 10 us a step) and happens only on a change; without one the saved state
is loaded as it is and the resume is bitwise. Ours (optim.schedule.ScheduledLR) re-plans a
changed schedule from the restored step instead, so that the lr never jumps (optim/schedule.py).
A MultiSched loads after the MultiOpt of its optimizers (the trainer registers them in that
order): that load restores the values the schedulers set, this one sets them for the build.
"""

import copy
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts, LambdaLR, LRScheduler, ReduceLROnPlateau

from optim.bundle import MultiOpt
from optim.errors import OptimError
from optim.schedule import ScheduledLR
from optim.tree import REFERENCE_FORMAT, Changes, malformed, plain, refuse_mismatch, require, same

# The state keys of torch's schedulers that record progress, not a setting: taken from the checkpoint.
_PROGRESS = frozenset({"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"})
_RESTART_PROGRESS = frozenset({"T_cur", "T_i"})  # CosineAnnealingWarmRestarts: where in which cycle


def _progress_keys(sched: LRScheduler) -> frozenset[str]:
    return _PROGRESS | (_RESTART_PROGRESS if isinstance(sched, CosineAnnealingWarmRestarts) else frozenset())


def driven_keys(sched: LRScheduler) -> set[str]:
    """The param-group keys `sched` sets as it steps: the lr, and the momentum (or beta1) that
    OneCycleLR and CyclicLR cycle; a SequentialLR's or ChainedScheduler's, those of its parts."""
    keys = {"lr"}
    if getattr(sched, "cycle_momentum", False):
        keys.add("betas" if getattr(sched, "use_beta1", False) else "momentum")
    for part in getattr(sched, "_schedulers", ()):
        keys |= driven_keys(part)
    return keys


def _steps_taken(state: Mapping[str, Any]) -> int:
    """How many times the scheduler whose state this is has stepped (a ChainedScheduler: its first part)."""
    if "last_epoch" in state:
        return int(state["last_epoch"])
    return _steps_taken(state["_schedulers"][0])


def _lambdas_effect(sched: LambdaLR, saved: Mapping[str, Any]) -> Changes:
    """The lrs the built lambdas give at the restored step against the saved ones, when they differ."""
    step = int(saved["last_epoch"])
    built = [base * fn(step) for fn, base in zip(sched.lr_lambdas, sched.base_lrs, strict=True)]
    return {} if same(saved["_last_lr"], built) else {f"lr at step {step} (lr_lambdas)": (saved["_last_lr"], built)}


def _reconcile(sched: LRScheduler, saved: Any, where: str) -> tuple[dict[str, Any], Changes]:
    """The state to load into torch scheduler `sched` (as built) from its checkpoint state `saved`:
    the progress saved, the settings built; with the settings (and a LambdaLR's effect) that differ.
    Changes nothing."""
    require(isinstance(saved, dict), where, "expected a dict")
    built = sched.state_dict()
    progress = _progress_keys(sched) & built.keys()
    missing = sorted(progress - saved.keys())
    require(not missing, where, f"it lacks {missing} (a {type(sched).__name__}'s state has {sorted(built)})")
    merged = {k: saved[k] if k in progress else v for k, v in built.items()}
    changes: Changes = {}
    for key, value in built.items():
        if key == "_schedulers" and isinstance(saved.get(key), list) and len(saved[key]) == len(value):
            # A SequentialLR's or ChainedScheduler's parts, each reconciled as a scheduler of its own.
            parts = [_reconcile(part, s, f"{where}/{i}") for i, (part, s) in
                     enumerate(zip(getattr(sched, "_schedulers", []), saved[key], strict=True))]
            merged[key] = [state for state, _ in parts]
            changes.update({f"{i}.{k}": v for i, (_, c) in enumerate(parts) for k, v in c.items()})
        elif key not in progress and not same(saved.get(key), value):
            changes[key] = (saved.get(key), plain(value, key))
    if isinstance(sched, LambdaLR) and not changes:
        changes = _lambdas_effect(sched, saved)
    return merged, changes


class _GroupsOf:
    """An optimizer's param groups without their parameters (and its defaults): what a copy of its
    scheduler steps, so that replaying a schedule touches no live optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "param_names")}
                             for g in optimizer.param_groups]
        self.defaults = copy.deepcopy(optimizer.defaults)

    def step(self) -> None:
        """Nothing to step: a schedule's replay moves only the groups' values."""


def _data_copy(value: Any) -> Any:  # any attribute of a scheduler
    """`value` with its containers and tensors copied; anything else (a function, a callable
    object, a number) is the same object: a copy never copies a task that a lambda is bound to."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_data_copy(v) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)  # its own type (a Counter's milestones), each entry set anew
        for k, v in value.items():
            out[k] = _data_copy(v)
        return out
    return value


def _as_built(sched: LRScheduler, groups: _GroupsOf) -> LRScheduler:
    """A copy of `sched` stepping `groups` (a stand-in of its optimizer), its parts copied too."""
    replica = copy.copy(sched)
    for key, value in vars(sched).items():
        vars(replica)[key] = (groups if key == "optimizer" else
                              [_as_built(part, groups) for part in value] if key == "_schedulers" else
                              _data_copy(value))
    return replica


class MultiSched:
    """Named schedulers, each named after the optimizer of a MultiOpt it drives, stepped together
    (or those of the optimizers that stepped: `step(names)`): ours (optim.schedule.ScheduledLR) or
    torch's (any `LRScheduler` stepped without a metric: not ReduceLROnPlateau). After a load,
    `hyperparameter_changes` holds each setting built otherwise than saved (`scheduler/key` ->
    (saved, built)), `restored_with_changes` the names of what differs from the saved state on
    purpose (as MultiOpt's), and `replanned` the schedule change ours made (None when none did)."""

    def __init__(self, schedulers: Mapping[str, LRScheduler]):
        self.schedulers = dict(schedulers)
        for name, sched in self.schedulers.items():
            if not isinstance(sched, LRScheduler) or isinstance(sched, ReduceLROnPlateau):
                raise TypeError(f"scheduler {name!r} is a {type(sched).__name__}; give a torch LRScheduler that "
                                "steps without a metric (ReduceLROnPlateau needs one the harness does not pass)")
        self.hyperparameter_changes: Changes = {}
        self._notes: list[str] = []
        # Copies as built, before any load: what a changed setting replays from (module docstring).
        self._built = {name: _as_built(s, _GroupsOf(s.optimizer)) for name, s in self.schedulers.items()
                       if not isinstance(s, ScheduledLR)}

    @property
    def driven(self) -> dict[str, set[str]]:
        """Optimizer name -> the param-group keys its scheduler sets (MultiOpt's `driven`)."""
        return {name: driven_keys(s) for name, s in self.schedulers.items()}

    @property
    def replanned(self) -> dict[str, Any] | None:
        return next((s.replanned for s in self.schedulers.values() if isinstance(s, ScheduledLR) and s.replanned), None)

    @property
    def restored_with_changes(self) -> list[str]:
        return sorted(self.hyperparameter_changes) + self._notes

    def step(self, names: Collection[str] | None = None) -> None:
        """Step every scheduler, or those of the optimizers `names`."""
        for name, sched in self.schedulers.items():
            if names is None or name in names:
                sched.step()

    def get_last_lr(self) -> dict[str, list[float | torch.Tensor]]:  # torch's type: an lr may be a tensor
        return {name: list(s.get_last_lr()) for name, s in self.schedulers.items()}

    def state_dict(self) -> dict[str, Any]:
        return {name: plain(s.state_dict(), f"sched.{name}") for name, s in self.schedulers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise OptimError(f"checkpoint sched is a {type(state_dict).__name__}, not a dict keyed by "
                            f"optimizer name: {REFERENCE_FORMAT}")
        refuse_mismatch("scheduler", "sched", state_dict, self.schedulers)
        # Check every state before loading any, so a refused load leaves the schedulers as they were.
        plans = {name: self._plan(name, sched, state_dict[name]) for name, sched in self.schedulers.items()}
        self.hyperparameter_changes, self._notes = {}, []
        for name, sched in self.schedulers.items():
            if isinstance(sched, ScheduledLR):
                sched.load_state_dict(state_dict[name])
                changes = sched.hyperparameter_changes
                self._notes += [f"{name}/{note}" for note in sched.notes]
            else:
                merged, changes = plans[name]
                self._load_torch(name, sched, merged, _steps_taken(state_dict[name]) if changes else None)
            self.hyperparameter_changes.update({f"{name}/{key}": values for key, values in changes.items()})

    def _plan(self, name: str, sched: LRScheduler, saved: Any) -> tuple[dict[str, Any], Changes]:
        """What loading `saved` into `sched` takes (`_reconcile`; ours: its own parse), checked."""
        where = f"sched/{name}"
        try:
            if isinstance(sched, ScheduledLR):
                require(isinstance(saved, dict), where, "expected a dict")
                sched.parse(saved)
                return {}, {}
            merged, changes = _reconcile(sched, saved, where)
            _steps_taken(saved)  # a replay needs it: a state without it is refused before any load
            return merged, changes
        except OptimError:
            raise
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise malformed(where, f"{type(e).__name__}: {e}") from None

    def _load_torch(self, name: str, sched: LRScheduler, merged: dict[str, Any], replay_to: int | None) -> None:
        """Load `merged` (`replay_to` None: nothing differs), else resume as built at step `replay_to`."""
        if replay_to is None:
            sched.load_state_dict(merged)
            # A torch scheduler sets its optimizer's lr when it steps, not when it loads: the lr it
            # had set when saved (MultiOpt's load restored it too; a part of a chain sets its own).
            for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr(), strict=True):
                group["lr"] = lr
            return
        built = self._built[name]
        replica = _as_built(built, _GroupsOf(built.optimizer))  # the copy as built stays for a later load
        with warnings.catch_warnings():  # its stand-in optimizer never steps: torch's order warning
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(replay_to - _steps_taken(replica.state_dict())):
                replica.step()
        sched.load_state_dict(replica.state_dict())
        driven = driven_keys(sched)
        for group, stepped in zip(sched.optimizer.param_groups, replica.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in stepped.items() if k in driven})


def bundle(optimizers: Mapping[str, torch.optim.Optimizer],
           schedulers: Mapping[str, LRScheduler]) -> tuple[MultiOpt, MultiSched]:
    """The resumable bundle of named optimizers and the schedulers named after the optimizer each
    drives. Raises ValueError (or TypeError) for a scheduler without its optimizer, one that drives
    another optimizer than the one it is named after, or a bundle MultiOpt / MultiSched refuse."""
    for name, sched in schedulers.items():
        if name not in optimizers:
            raise ValueError(f"scheduler {name!r} has no optimizer of that name ({sorted(optimizers)}); "
                             "name each scheduler after the optimizer it drives")
        if getattr(sched, "optimizer", None) is not optimizers[name]:
            raise ValueError(f"scheduler {name!r} drives another optimizer than {name!r}; name each scheduler "
                             "after the optimizer it drives")
    multi_sched = MultiSched(schedulers)
    return MultiOpt(optimizers, multi_sched.driven), multi_sched
