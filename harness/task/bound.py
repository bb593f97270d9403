"""`BoundTask`: a task object checked once and its optional methods filled in, so the trainer calls
one interface whatever the task is (contract.py). Everything it calls on the user's object at
build time (data, models, optimizers, state) turns an exception into one line naming the task and
the method; an exception in `loss` / `step` during training is the user's code failing, and keeps
its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from harness.errors import UserError
from harness.log import get_logger
from harness.task.contract import StepInfo, StepLoss, TaskContext, batch_samples
from harness.task.data import TrainData, task_data
from optim.bundle import MultiOpt
from optim.schedulers import MultiSched, bundle

log = get_logger(__name__)

REQUIRED = ("models", "data")
# The harness's own parts: a task's extra state may not take their names.
RESERVED_PARTS = ("model", "optim", "sched", "data", "scaler", "trainer", "rng", "fingerprints")


class BoundTask:
    """`task` (named `name` in messages: its factory path) behind the one interface the trainer uses."""

    def __init__(self, task: Any, name: str) -> None:
        missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
        if not callable(getattr(task, "loss", None)) and not callable(getattr(task, "step", None)):
            missing.append("loss (or step)")
        if missing:
            raise UserError(f"task {name!r} ({type(task).__name__}) has no {' and no '.join(missing)} method; a task "
                            "needs models(ctx), data(ctx) and loss(models, batch) or step(models, optim, batch, info) "
                            "(docs/tasks.md)")
        self.task = task
        self.name = name
        self.has_step = callable(getattr(task, "step", None))
        evaluates = callable(getattr(task, "loss", None)) or callable(getattr(task, "evaluate", None))
        if self.has_step and not evaluates:
            raise UserError(f"task {name!r} has step but neither loss nor evaluate: the harness evaluates a task with "
                            "its evaluate(models, batches), or the mean of its loss; define one (docs/tasks.md)")

    def _call(self, method: str, *args: Any) -> Any:
        """A build-time method of the task; its exception becomes a one-line UserError."""
        try:
            return getattr(self.task, method)(*args)
        except UserError:
            raise
        except Exception as e:
            log.debug("the task raised", task=self.name, method=method, exc_info=True)
            raise UserError(f"task {self.name!r}: {method}() failed with {type(e).__name__}: {e} (--log-level debug "
                            "shows the traceback)") from None

    def data(self, ctx: TaskContext) -> TrainData:
        """The train and eval sources (harness/task/data.py checks and adapts them)."""
        return task_data(self._call("data", ctx), self.name, self.collate)

    def models(self, ctx: TaskContext) -> nn.Module:
        """The task's model, or its several models as one `nn.ModuleDict` (parameter names
        `name.param`): the `model` part."""
        built = self._call("models", ctx)
        if isinstance(built, Mapping):
            bad = [k for k, m in built.items() if not isinstance(m, nn.Module)]
            if bad or not built:
                raise UserError(f"task {self.name!r}: models() returned a mapping whose {bad or 'entries are none'} "
                                "are not torch.nn.Module; return a module, or {name: module}")
            built = nn.ModuleDict(dict(built))
        if not isinstance(built, nn.Module):
            raise UserError(f"task {self.name!r}: models() returned a {type(built).__name__}; return a torch.nn.Module "
                            "or a dict of them (docs/tasks.md)")
        trainable = [p for p in built.parameters() if p.requires_grad]
        if not trainable:
            raise UserError(f"task {self.name!r}: its models have no trainable parameter: there is nothing to train")
        empty = [n for n, p in built.named_parameters() if p.requires_grad and p.numel() == 0]
        if empty:
            raise UserError(f"task {self.name!r}: parameter(s) with no elements: {', '.join(empty)}")
        return built

    def optimizers(self, model: nn.Module, ctx: TaskContext) -> tuple[MultiOpt, MultiSched] | None:
        """The task's own bundle, its parameters named by the model part's names (so every
        optimizer's state is saved under them, whatever names the task gave), or None: the
        `[optim]` config's."""
        if not callable(getattr(self.task, "optimizers", None)):
            return None
        built = self._call("optimizers", model, ctx)
        if built is None:
            return None
        if not (isinstance(built, tuple) and len(built) == 2):
            raise UserError(f"task {self.name!r}: optimizers() returned a {type(built).__name__}; return (optimizers, "
                            "schedulers): {name: torch optimizer} and {name: scheduler} (or a MultiOpt and a "
                            "MultiSched), or None for the [optim] config's")
        optimizers = self._named(built[0], "optimizers", MultiOpt, "optimizers")
        schedulers = self._named(built[1], "schedulers", MultiSched, "schedulers")
        if not optimizers:
            raise UserError(f"task {self.name!r}: optimizers() returned no optimizer")
        strangers = [f"{n!r} is a {type(o).__name__}" for n, o in optimizers.items()
                     if not isinstance(o, torch.optim.Optimizer)]
        if strangers:
            raise UserError(f"task {self.name!r}: optimizers() returned optimizer {strangers[0]}, not a "
                            "torch.optim.Optimizer")
        name_parameters(optimizers, model, self.name)
        try:
            return bundle(optimizers, schedulers)
        except (ValueError, TypeError) as e:
            raise UserError(f"task {self.name!r}: {e}") from None

    def _named(self, value: Any, what: str, ours: type, attribute: str) -> dict[str, Any]:
        """`optimizers()`'s optimizers or schedulers as {name: object}: a mapping, or our bundle
        class `ours` (its `attribute`); None is no schedulers. UserError for anything else (a
        list, another project's MultiOpt)."""
        if isinstance(value, ours):
            return dict(getattr(value, attribute))
        if isinstance(value, Mapping) or (value is None and what == "schedulers"):
            return dict(value or {})
        where = getattr(type(value), "__module__", "")
        raise UserError(f"task {self.name!r}: optimizers() returned its {what} as a {type(value).__name__}"
                        f"{f' (from {where})' if where not in ('builtins', '') else ''}; return {{name: {what[:-1]}}} "
                        f"(or {ours.__module__.split('.')[0]}.{ours.__name__}) for each, e.g. "
                        "({'adamw': AdamW(...)}, {'adamw': LambdaLR(...)}), or None for the [optim] config's")

    def micro_batch(self, models: nn.Module, optim: MultiOpt, batch: Any,
                    info: StepInfo) -> tuple[torch.Tensor, tuple[str, ...] | None]:
        """One micro-batch's loss and the optimizers it steps (None: all)."""
        if not self.has_step:
            return _scalar(self.task.loss(models, batch), self.name, "loss"), None
        out = self.task.step(models, optim, batch, info)
        if isinstance(out, StepLoss):
            stepping = None if out.optimizers is None else tuple(out.optimizers)
            return _scalar(out.loss, self.name, "step"), stepping
        return _scalar(out, self.name, "step"), None

    def evaluate(self, models: nn.Module, batches: Any) -> dict[str, float]:
        """`eval_<metric>` -> value of the task's `evaluate` (default: the mean of its loss)."""
        if callable(getattr(self.task, "evaluate", None)):
            metrics = self.task.evaluate(models, batches)
        else:
            losses = [float(self.task.loss(models, batch)) for batch in batches]
            metrics = {"loss": sum(losses) / max(len(losses), 1)}
        if not isinstance(metrics, Mapping):
            raise UserError(f"task {self.name!r}: evaluate() returned a {type(metrics).__name__}; return "
                            "{metric: float}")
        return {k if k.startswith("eval_") else f"eval_{k}": float(v) for k, v in metrics.items()}

    def state(self) -> dict[str, Any]:
        """The task's extra state parts, by name."""
        if not callable(getattr(self.task, "state", None)):
            return {}
        parts = self._call("state")
        if not isinstance(parts, Mapping):
            raise UserError(f"task {self.name!r}: state() returned a {type(parts).__name__}; return {{name: part}}")
        taken = sorted(set(parts) & set(RESERVED_PARTS))
        if taken:
            raise UserError(f"task {self.name!r}: state() names a part {taken[0]!r}, which is the harness's own "
                            f"({', '.join(RESERVED_PARTS)}); rename it")
        for name, part in parts.items():
            if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
                raise UserError(f"task {self.name!r}: state part {name!r} ({type(part).__name__}) has no state_dict / "
                                "load_state_dict")
        return dict(parts)

    def after_step(self, models: nn.Module, info: StepInfo) -> None:
        if callable(getattr(self.task, "after_step", None)):
            with torch.no_grad():
                self.task.after_step(models, info)

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        own = getattr(self.task, "collate", None)
        return own if callable(own) else default_collate

    def tokens(self, batch: Any) -> int:
        own = getattr(self.task, "tokens", None)
        return int(own(batch)) if callable(own) else batch_samples(batch)


def _scalar(loss: Any, name: str, method: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise UserError(f"task {name!r}: {method}() returned {got}; it must return the micro-batch's loss as a scalar "
                        "tensor (docs/tasks.md)")
    return loss


def name_parameters(optimizers: Mapping[str, torch.optim.Optimizer], model: nn.Module, task: str) -> None:
    """Give every group of every optimizer the `param_names` of its parameters in `model` (what the
    bundle keys their state by, optim/bundle.py), whatever names the task gave them, or none.
    UserError for a parameter that is not one of the model's."""
    names = {id(p): n for n, p in model.named_parameters()}
    for opt_name, opt in optimizers.items():
        for group in opt.param_groups:
            strangers = [i for i, p in enumerate(group["params"]) if id(p) not in names]
            if strangers:
                raise UserError(f"task {task!r}: optimizer {opt_name!r} holds a parameter that is not one of the "
                                "models' (built before the models were returned, or from a copy); build it from "
                                "the models optimizers() receives")
            group["param_names"] = [names[id(p)] for p in group["params"]]
