"""MultiOpt / MultiSched: named torch optimizers (and their schedulers) as one resumable part.

Why: a run trains block matrices with one rule (Muon, Lion, ...) and the rest with AdamW, and a
checkpoint must restore each state onto the right tensor after a restart, even when the model
lists its parameters in another order. torch keys optimizer state by position; modded-nanogpt
style code keys it by `id(p)`, which silently restores nothing after a restart. Here every
optimizer has a name and every parameter its `model.named_parameters()` name.

State dict (a plain tree: dict/list/Tensor/int/float/str/bool/None, no tuples on save, so it
survives safetensors + JSON unchanged; lists are accepted where the optimizer had tuples):
    MultiOpt:   {opt_name: {"state": {param_name: {key: value}},
                            "param_groups": [{hyperparameter: value, "params": [param_name]}]}}
    MultiSched: {opt_name: scheduler.state_dict()}   (optim.schedule.ScheduledLR's)

What a load takes from the checkpoint: the per-parameter state (momentum, moments, ...) and
the schedulers' step counters. What it keeps from the bundle as built (the config): every
group's hyperparameters (lr, betas, weight decay, momentum, ...), the grouping of parameters and
the schedule, so `--allow-config-change` with a new lr takes effect from the first resumed
step; with an unchanged config the result is the saved state bit for bit.

Loading raises `optim.errors.OptimError` before changing anything when the checkpoint does not
fit: a state that is not this name-keyed format (the team reference's positional list, for one),
a missing or extra optimizer, parameter or scheduler, a group whose hyperparameter keys differ
from this optimizer's (another version of the optimizer), a state entry whose keys differ from
the ones the optimizer keeps (a missing `mom` would silently restart momentum at zero), or a
tensor whose shape differs. Loaded tensors become the optimizer's state as they are (no copy
when dtype and device already match), so a resume never holds two copies of the optimizer state.
"""

from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeAlias, overload

import torch

from optim.errors import OptimError
from optim.schedule import ScheduledLR

_REFERENCE_FORMAT = ("it looks like the team reference's positional MultiOpt state (one torch state dict "
                     "per optimizer, in list order); this bundle loads only its own name-keyed state "
                     "(optim.bundle), so resume from a checkpoint written by the harness")


# A checkpoint-safe tree (module docstring): what `_plain` makes of a state.
Tree: TypeAlias = "torch.Tensor | bool | int | float | str | None | list[Tree] | dict[str, Tree]"


@overload
def _plain(value: Mapping[str, object], where: str) -> dict[str, Tree]: ...
@overload
def _plain(value: object, where: str) -> Tree: ...
def _plain(value: object, where: str) -> Tree:
    """`value` as a checkpoint-safe tree (tuples become lists); anything else is a bug."""
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold")


def _refuse_mismatch(kind: str, where: str, saved: Iterable[str], current: Iterable[str]) -> None:
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing:
        raise OptimError(f"checkpoint {where} lacks {kind} {missing[0]!r} (missing: {missing}); "
                        "resume with the config the checkpoint was written with")
    if extra:
        raise OptimError(f"checkpoint {where} has {kind} {extra[0]!r} that this run does not "
                        f"(extra: {extra}); resume with the config the checkpoint was written with")


def _require(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise OptimError(f"checkpoint {where} is malformed: {what}; it was not written by this "
                        "harness's optimizer bundle")


def _torch_state_keys(opt: torch.optim.Optimizer,
                      group: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the state keys shaped like the parameter, the scalar ones) of torch's own optimizers, or
    None for another class. AdamW subclasses Adam; the conditional keys follow the group's flags."""
    if isinstance(opt, torch.optim.Adam):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()), ("step",)
    if isinstance(opt, torch.optim.SGD):
        return ("momentum_buffer",) if group["momentum"] != 0 else (), ()
    if isinstance(opt, torch.optim.RMSprop):
        return (("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ())
                + (("grad_avg",) if group["centered"] else ())), ("step",)
    table = {torch.optim.Adagrad: (("sum",), ("step",)), torch.optim.Adamax: (("exp_avg", "exp_inf"), ("step",)),
             torch.optim.NAdam: (("exp_avg", "exp_avg_sq"), ("step", "mu_product")),
             torch.optim.RAdam: (("exp_avg", "exp_avg_sq"), ("step",)),
             torch.optim.Adadelta: (("square_avg", "acc_delta"), ("step",)),
             torch.optim.ASGD: (("ax",), ("step", "eta", "mu")), torch.optim.Rprop: (("prev", "step_size"), ("step",))}
    return next((keys for cls, keys in table.items() if isinstance(opt, cls)), None)


def state_shapes(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The state keys `opt` keeps for `p` (in `group`) once it has stepped, with their shapes.

    Our optimizers declare theirs (`state_shapes(p)`); torch's own (Adam, AdamW, SGD, RMSprop,
    Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop) are known here. Raises TypeError for any
    other optimizer (MultiOpt refuses it when built)."""
    if hasattr(opt, "state_shapes"):
        return {k: tuple(v) for k, v in opt.state_shapes(p).items()}
    keys = _torch_state_keys(opt, group)
    if keys is None:
        raise TypeError(f"{type(opt).__name__} does not declare its state keys; give it a "
                        "state_shapes(p) -> {key: shape} method")
    shaped, scalars = keys
    return {**{k: () for k in scalars}, **{k: tuple(p.shape) for k in shaped}}


def _check_group_keys(where: str, opt: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Every saved group must carry exactly the hyperparameter keys of this optimizer's groups."""
    live = set(opt.param_groups[0]) - {"params", "param_names"}
    for i, group in enumerate(saved_groups):
        keys = set(group) - {"params"}
        missing, extra = sorted(live - keys), sorted(keys - live)
        if missing or extra:
            what = f"lacks hyperparameter {missing[0]!r}" if missing else f"has hyperparameter {extra[0]!r}"
            raise OptimError(f"checkpoint {where} group {i} {what} that {type(opt).__name__} here does "
                            f"{'' if missing else 'not '}have (missing: {missing}, extra: {extra}); "
                            "it was written by another version of the optimizer: resume with that version")


def _check_shape(where: str, opt: torch.optim.Optimizer, saved: Any) -> None:  # any value a checkpoint holds
    _require(isinstance(saved, dict) and isinstance(saved.get("state"), dict)
             and isinstance(saved.get("param_groups"), list), where,
             'expected {"state": {...}, "param_groups": [...]}')
    for i, group in enumerate(saved["param_groups"]):
        _require(isinstance(group, dict) and isinstance(group.get("params"), list)
                 and all(isinstance(n, str) for n in group["params"]), f"{where} group {i}",
                 "expected a dict whose 'params' lists parameter names")
    for name, entry in saved["state"].items():
        _require(isinstance(entry, dict), f"{where}/{name}", "a parameter's state must be a dict")


def _changed_hyperparameters(saved_groups: list[dict[str, Any]],
                             owners: dict[str, tuple[torch.Tensor, dict[str, Any]]]) -> set[str]:
    """Hyperparameter keys whose live value for some parameter differs from the checkpoint's
    (`lr` is the schedule's, compared through `initial_lr`)."""
    changed: set[str] = set()
    for group in saved_groups:
        for name in group["params"]:
            live = owners[name][1]
            changed |= {k for k, v in group.items()
                        if k not in ("params", "lr") and _plain(live[k], k) != v}
    return changed


def _positional(where: str, opt: torch.optim.Optimizer, saved: Any) -> tuple[dict[str, Any], set[str]]:
    """Translate one optimizer's name-keyed state into torch's positional form over the live
    groups (their hyperparameters and grouping), after checking names, keys and shapes; with
    the hyperparameter keys whose values the live groups change."""
    _check_shape(where, opt, saved)
    saved_groups = saved["param_groups"]
    _refuse_mismatch("parameter", where,
                     [n for g in saved_groups for n in g["params"]],
                     [n for g in opt.param_groups for n in g["param_names"]])
    _check_group_keys(where, opt, saved_groups)
    positions: dict[str, int] = {}
    owners: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
    torch_groups: list[dict[str, Any]] = []
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        ids = list(range(len(positions), len(positions) + len(group["params"])))
        for pos, name, p in zip(ids, group["param_names"], group["params"], strict=True):
            positions[name], owners[name] = pos, (p, group)
        torch_groups.append({**hyper, "params": ids, "param_names": list(group["param_names"])})
    state: dict[int, dict[str, Any]] = {}
    for name, entry in saved["state"].items():
        if name not in owners:
            raise OptimError(f"checkpoint {where} has state for {name!r}, which is in none of its "
                            "parameter groups; the checkpoint is inconsistent")
        p, group = owners[name]
        expected = state_shapes(opt, p, group)
        missing, unknown = sorted(set(expected) - set(entry)), sorted(set(entry) - set(expected))
        if unknown:
            raise OptimError(f"checkpoint {where}/{name} has state {unknown[0]!r}, which "
                            f"{type(opt).__name__} does not keep (it keeps {sorted(expected)}); "
                            "the checkpoint was written by another optimizer or version")
        if missing:
            raise OptimError(f"checkpoint {where}/{name} lacks state {missing[0]!r} (has {sorted(entry)}); "
                            f"{type(opt).__name__} would silently restart it at zero: the checkpoint "
                            "is damaged or was written by another optimizer or version")
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected[key]:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise OptimError(f"tensor {where}/{name}/{key} has shape {got}, this run expects "
                                f"{expected[key]}")
        state[positions[name]] = dict(entry)
    return {"state": state, "param_groups": torch_groups}, _changed_hyperparameters(saved_groups, owners)


class MultiOpt:
    """Named torch optimizers stepped together; `param_groups` lists every group of every one.

    Each optimizer must be built from named parameters (torch's `(name, param)` form), so that
    every group carries `param_names`; a parameter may belong to one optimizer only; each must
    declare its state keys (`state_shapes`). After a load, `restored_with_changes` lists the
    hyperparameters (`optimizer/key`) whose values this bundle's config changed, so the restored
    state differs from the saved one on purpose (empty when none did).
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)
        self.restored_with_changes: list[str] = []
        owner: dict[str, str] = {}
        for opt_name, opt in self.optimizers.items():
            for group in opt.param_groups:
                if "param_names" not in group:
                    raise ValueError(f"optimizer {opt_name!r} was built without parameter names; "
                                     "pass model.named_parameters() pairs")
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    if name in owner:
                        raise ValueError(f"parameter {name!r} is in both {owner[name]!r} "
                                         f"and {opt_name!r}")
                    owner[name] = opt_name
                    try:
                        state_shapes(opt, p, group)
                    except TypeError as e:
                        raise ValueError(f"optimizer {opt_name!r}: {e}") from None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for opt_name, opt in self.optimizers.items():
            state: dict[str, Tree] = {}
            groups: list[dict[str, Tree]] = []
            for group in opt.param_groups:
                hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                groups.append({**_plain(hyper, f"{opt_name}.param_groups"),
                               "params": list(group["param_names"])})
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    if p in opt.state:
                        state[name] = _plain(opt.state[p], f"{opt_name}.state.{name}")
            out[opt_name] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise OptimError(f"checkpoint optim is a {type(state_dict).__name__}, not a dict keyed by "
                            f"optimizer name: {_REFERENCE_FORMAT}")
        _refuse_mismatch("optimizer", "optim", state_dict, self.optimizers)
        # Check every optimizer before loading any, so a refused load leaves the bundle as it was.
        positional = {name: _positional(f"optim/{name}", opt, state_dict[name])
                      for name, opt in self.optimizers.items()}
        for name, opt in self.optimizers.items():
            opt.load_state_dict(positional[name][0])
        self.restored_with_changes = sorted(f"{name}/{key}" for name, (_, keys) in positional.items() for key in keys)


class MultiSched:
    """Named schedulers, each named after the optimizer of a MultiOpt it drives, stepped together
    (or those of the optimizers that stepped: `step(names)`). Ours (optim.schedule.ScheduledLR)
    or any with state_dict / load_state_dict / step / get_last_lr (torch's LR schedulers). After
    a load, `replanned` is the schedule change ours made (None when it kept the schedule) and
    `restored_with_changes` what differs from the saved state on purpose (as in MultiOpt:
    `scheduler/what`)."""

    def __init__(self, schedulers: Mapping[str, ScheduledLR]):
        self.schedulers = dict(schedulers)

    @property
    def replanned(self) -> dict[str, Any] | None:
        return next((s.replanned for s in self.schedulers.values() if getattr(s, "replanned", None)), None)

    @property
    def restored_with_changes(self) -> list[str]:
        return [f"{name}/{what}" for name, s in self.schedulers.items()
                for what in getattr(s, "restored_with_changes", ())]

    def step(self, names: Collection[str] | None = None) -> None:
        """Step every scheduler, or those of the optimizers `names`."""
        for name, sched in self.schedulers.items():
            if names is None or name in names:
                sched.step()

    def get_last_lr(self) -> dict[str, list[float | torch.Tensor]]:  # torch's type: an lr may be a tensor
        return {name: list(s.get_last_lr()) for name, s in self.schedulers.items()}

    def state_dict(self) -> dict[str, Any]:
        return {name: _plain(s.state_dict(), f"sched.{name}") for name, s in self.schedulers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise OptimError(f"checkpoint sched is a {type(state_dict).__name__}, not a dict keyed by "
                            f"optimizer name: {_REFERENCE_FORMAT}")
        _refuse_mismatch("scheduler", "sched", state_dict, self.schedulers)
        # Parse every state before loading any, so a refused load leaves the schedulers as they were.
        for name, sched in self.schedulers.items():
            try:
                _require(isinstance(state_dict[name], dict), f"sched/{name}", "expected a dict")
                if hasattr(sched, "parse"):
                    sched.parse(state_dict[name])
            except (TypeError, ValueError, KeyError) as e:
                _require(False, f"sched/{name}", f"{type(e).__name__}: {e}")
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state_dict[name])
            if not hasattr(sched, "parse"):
                # A torch scheduler sets its optimizer's lr when it steps, not when it loads, and
                # MultiOpt keeps the live groups' lr: put back the lr it had set when saved.
                for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr(), strict=True):
                    group["lr"] = lr
