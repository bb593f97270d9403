"""MultiOpt: named torch optimizers as one resumable part (their schedulers: optim/schedulers.py).

Why: a run trains block matrices with one rule (Muon, Lion, ...) and the rest with AdamW, and a
checkpoint must restore each state onto the right tensor after a restart, even when the model
lists its parameters in another order. torch keys optimizer state by position; modded-nanogpt
style code keys it by `id(p)`, which silently restores nothing after a restart. Here every
optimizer has a name and every parameter its `model.named_parameters()` name.

State dict (a plain tree, optim/tree.py; lists are accepted where the optimizer had tuples):
    {opt_name: {"state": {param_name: {key: value}},
                "param_groups": [{hyperparameter: value, "params": [param_name]}]}}

What a load takes from the checkpoint: the per-parameter state (momentum, moments, ...) and
the values a scheduler sets as it steps (`driven`: the lr, a cycled momentum). What it keeps from
the bundle as built (the config, the task's code): every other hyperparameter of every group (lr
without a scheduler, betas, weight decay, momentum, eps, `initial_lr`, ...) and the grouping of
parameters; each that differs from the checkpoint's is named with both values
(`hyperparameter_changes`), for the harness to refuse or record (`--allow-config-change`): a new
value takes effect from the first resumed step, and with an unchanged build the result is the
saved state bit for bit.

Loading raises `optim.errors.OptimError` before changing anything when the checkpoint does not
fit: a state that is not this name-keyed format (the team reference's positional list, for one),
a missing or extra optimizer or parameter, a group whose hyperparameter keys differ
from this optimizer's (another version of the optimizer), a state entry whose keys differ from
the ones the optimizer keeps (a missing `mom` would silently restart momentum at zero), or a
tensor whose shape differs. Loaded tensors become the optimizer's state as they are (no copy
when dtype and device already match), so a resume never holds two copies of the optimizer state."""

from collections.abc import Collection, Mapping
from typing import Any

import torch

from optim.errors import OptimError
from optim.tree import REFERENCE_FORMAT, Changes, Tree, plain, refuse_mismatch, require, same


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
    require(isinstance(saved, dict) and isinstance(saved.get("state"), dict)
             and isinstance(saved.get("param_groups"), list), where,
             'expected {"state": {...}, "param_groups": [...]}')
    for i, group in enumerate(saved["param_groups"]):
        require(isinstance(group, dict) and isinstance(group.get("params"), list)
                 and all(isinstance(n, str) for n in group["params"]), f"{where} group {i}",
                 "expected a dict whose 'params' lists parameter names")
    for name, entry in saved["state"].items():
        require(isinstance(entry, dict), f"{where}/{name}", "a parameter's state must be a dict")


def _changed_hyperparameters(saved_groups: list[dict[str, Any]], live_groups: dict[str, dict[str, Any]],
                             driven: Collection[str]) -> Changes:
    """Hyperparameter -> (saved value, live value) for each key whose live value differs from the
    checkpoint's for some parameter (the first such parameter's), the `driven` ones left out."""
    changed: Changes = {}
    for group in saved_groups:
        for name in group["params"]:
            live = live_groups[name]
            for key, value in group.items():
                if key not in changed and key != "params" and key not in driven and not same(value, live[key]):
                    changed[key] = (value, plain(live[key], key))
    return changed


def _check_state(where: str, opt: torch.optim.Optimizer, name: str, entry: dict[str, Any],
                 p: torch.Tensor, group: dict[str, Any]) -> None:
    """`entry`, the saved state of parameter `name`, holds exactly the tensors `opt` keeps for `p`, shaped as `p`'s."""
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
            raise OptimError(f"tensor {where}/{name}/{key} has shape {got}, this run expects {expected[key]}")


def _positional(where: str, opt: torch.optim.Optimizer, saved: Any,
                driven: Collection[str]) -> tuple[dict[str, Any], Changes]:
    """Translate one optimizer's name-keyed state into torch's positional form over the live
    groups (their hyperparameters and grouping; the `driven` keys as saved), after checking
    names, keys and shapes; with the hyperparameters whose live values differ from the saved ones."""
    _check_shape(where, opt, saved)
    saved_groups = saved["param_groups"]
    refuse_mismatch("parameter", where,
                    [n for g in saved_groups for n in g["params"]],
                    [n for g in opt.param_groups for n in g["param_names"]])
    _check_group_keys(where, opt, saved_groups)
    saved_group_of = {name: group for group in saved_groups for name in group["params"]}
    positions: dict[str, int] = {}
    owners: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
    torch_groups: list[dict[str, Any]] = []
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        # What the scheduler set when the checkpoint was written; its own load sets it anew.
        first = saved_group_of.get(group["param_names"][0]) if group["param_names"] else None
        hyper.update({k: first[k] for k in driven if first is not None and k in hyper})
        ids = list(range(len(positions), len(positions) + len(group["params"])))
        for pos, name, p in zip(ids, group["param_names"], group["params"], strict=True):
            positions[name], owners[name] = pos, (p, group)
        torch_groups.append({**hyper, "params": ids, "param_names": list(group["param_names"])})
    state: dict[int, dict[str, Any]] = {}
    for name, entry in saved["state"].items():
        if name not in owners:
            raise OptimError(f"checkpoint {where} has state for {name!r}, which is in none of its "
                            "parameter groups; the checkpoint is inconsistent")
        _check_state(where, opt, name, entry, *owners[name])
        state[positions[name]] = dict(entry)
    changed = _changed_hyperparameters(saved_groups, {n: g for n, (_, g) in owners.items()}, driven)
    return {"state": state, "param_groups": torch_groups}, changed


class MultiOpt:
    """Named torch optimizers stepped together; `param_groups` lists every group of every one.

    Each optimizer must be built from named parameters (torch's `(name, param)` form), so that
    every group carries `param_names`; a parameter may belong to one optimizer only; each must
    declare its state keys (`state_shapes`). `driven`: optimizer name -> the group keys its
    scheduler sets as it steps (`lr`, a cycled momentum: `MultiSched.driven`), which a load
    restores as saved and leaves to the scheduler's load. After a load, `hyperparameter_changes`
    holds every other hyperparameter whose value as built differs from the checkpoint's
    (`optimizer/key` -> (saved, built)): the built one is in force; `restored_with_changes` lists
    their names (the restored state differs from the saved one on purpose; empty when none does).
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer],
                 driven: Mapping[str, Collection[str]] | None = None):
        self.optimizers = dict(optimizers)
        self.driven = {name: frozenset((driven or {}).get(name, ())) for name in self.optimizers}
        self.hyperparameter_changes: Changes = {}
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
    def restored_with_changes(self) -> list[str]:
        return sorted(self.hyperparameter_changes)

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
                groups.append({**plain(hyper, f"{opt_name}.param_groups"),
                               "params": list(group["param_names"])})
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    if p in opt.state:
                        state[name] = plain(opt.state[p], f"{opt_name}.state.{name}")
            out[opt_name] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise OptimError(f"checkpoint optim is a {type(state_dict).__name__}, not a dict keyed by "
                            f"optimizer name: {REFERENCE_FORMAT}")
        refuse_mismatch("optimizer", "optim", state_dict, self.optimizers)
        # Check every optimizer before loading any, so a refused load leaves the bundle as it was.
        positional = {name: _positional(f"optim/{name}", opt, state_dict[name], self.driven[name])
                      for name, opt in self.optimizers.items()}
        for name, opt in self.optimizers.items():
            opt.load_state_dict(positional[name][0])
        self.hyperparameter_changes = {f"{name}/{key}": values for name, (_, changed) in positional.items()
                                       for key, values in sorted(changed.items())}
