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
    MultiSched: {opt_name: scheduler.state_dict() without `lr_lambdas`}
Schedule functions come from the config, never from a checkpoint.

Loading raises `harness.errors.UserError` naming the missing or extra optimizer, parameter or
scheduler, a parameter that moved to another group, or a tensor whose shape differs. Loaded
tensors become the optimizer's state as they are (no copy when dtype and device already match),
so a resume never holds two copies of the optimizer state.
"""

import torch

from harness.errors import UserError


def _plain(value, where: str):
    """`value` as a checkpoint-safe tree (tuples become lists); anything else is a bug."""
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold")


def _refuse_mismatch(kind: str, where: str, saved, current) -> None:
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing:
        raise UserError(f"checkpoint {where} lacks {kind} {missing[0]!r} (missing: {missing}); "
                        "resume with the config the checkpoint was written with")
    if extra:
        raise UserError(f"checkpoint {where} has {kind} {extra[0]!r} that this run does not "
                        f"(extra: {extra}); resume with the config the checkpoint was written with")


def _expected_shape(opt: torch.optim.Optimizer, p: torch.Tensor, key: str):
    shapes = opt.state_shapes(p) if hasattr(opt, "state_shapes") else {}
    return tuple(shapes.get(key, p.shape))


def _positional(where: str, opt: torch.optim.Optimizer, saved: dict) -> dict:
    """Translate one optimizer's name-keyed state into torch's positional form, in the
    current parameter order, after checking names, groups and shapes."""
    groups = opt.param_groups
    saved_groups = saved["param_groups"]
    _refuse_mismatch("parameter", where,
                     [n for g in saved_groups for n in g["params"]],
                     [n for g in groups for n in g["param_names"]])
    if len(saved_groups) != len(groups):
        raise UserError(f"checkpoint {where} has {len(saved_groups)} parameter groups, this "
                        f"run {len(groups)}; resume with the same head/matrix split")
    positions, params, torch_groups = {}, {}, []
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        moved = sorted(set(group["param_names"]) - set(saved_group["params"]))
        if moved:
            raise UserError(f"parameter {moved[0]!r} is in group {i} of {where} but the "
                            "checkpoint has it in another group; resume with the same split")
        hyper = {k: tuple(v) if isinstance(group.get(k), tuple) else v
                 for k, v in saved_group.items() if k != "params"}
        ids = list(range(len(positions), len(positions) + len(group["params"])))
        for pos, name, p in zip(ids, group["param_names"], group["params"]):
            positions[name], params[name] = pos, p
        torch_groups.append({**hyper, "params": ids, "param_names": list(group["param_names"])})
    state = {}
    for name, entry in saved["state"].items():
        if name not in params:
            raise UserError(f"checkpoint {where} has state for {name!r}, which is in none of its "
                            "parameter groups; the checkpoint is inconsistent")
        p = params[name]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                expected = _expected_shape(opt, p, key)
                if tuple(value.shape) != expected:
                    raise UserError(f"tensor {where}/{name}/{key} has shape "
                                    f"{tuple(value.shape)}, this run expects {expected}")
        state[positions[name]] = dict(entry)
    return {"state": state, "param_groups": torch_groups}


class MultiOpt:
    """Named torch optimizers stepped together; `param_groups` lists every group of every one.

    Each optimizer must be built from named parameters (torch's `(name, param)` form), so that
    every group carries `param_names`; a parameter may belong to one optimizer only.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)
        owner: dict[str, str] = {}
        for opt_name, opt in self.optimizers.items():
            for group in opt.param_groups:
                if "param_names" not in group:
                    raise ValueError(f"optimizer {opt_name!r} was built without parameter names; "
                                     "pass model.named_parameters() pairs")
                for name in group["param_names"]:
                    if name in owner:
                        raise ValueError(f"parameter {name!r} is in both {owner[name]!r} "
                                         f"and {opt_name!r}")
                    owner[name] = opt_name

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        out = {}
        for opt_name, opt in self.optimizers.items():
            state, groups = {}, []
            for group in opt.param_groups:
                hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                groups.append({**_plain(hyper, f"{opt_name}.param_groups"),
                               "params": list(group["param_names"])})
                for name, p in zip(group["param_names"], group["params"]):
                    if p in opt.state:
                        state[name] = _plain(opt.state[p], f"{opt_name}.state.{name}")
            out[opt_name] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        _refuse_mismatch("optimizer", "optim", state_dict, self.optimizers)
        # Check every optimizer before loading any, so a refused load leaves the bundle as it was.
        positional = {name: _positional(f"optim/{name}", opt, state_dict[name])
                      for name, opt in self.optimizers.items()}
        for name, opt in self.optimizers.items():
            opt.load_state_dict(positional[name])


class MultiSched:
    """Named LR schedulers, one per optimizer of a MultiOpt, stepped together."""

    def __init__(self, schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = dict(schedulers)

    def step(self) -> None:
        for sched in self.schedulers.values():
            sched.step()

    def get_last_lr(self) -> dict[str, list[float]]:
        return {name: list(s.get_last_lr()) for name, s in self.schedulers.items()}

    def state_dict(self) -> dict:
        return {name: _plain({k: v for k, v in s.state_dict().items() if k != "lr_lambdas"},
                             f"sched.{name}")
                for name, s in self.schedulers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        _refuse_mismatch("scheduler", "sched", state_dict, self.schedulers)
        for name, sched in self.schedulers.items():
            state = dict(state_dict[name])
            if hasattr(sched, "lr_lambdas"):
                # None tells LambdaLR to keep its own function (a plain function has no state).
                state["lr_lambdas"] = [None] * len(sched.lr_lambdas)
            sched.load_state_dict(state)
