"""The model factory contract, checked where it is used, so a model that breaks it is a one-line
error naming the rule instead of a traceback from deep inside the trainer (docs/models.md).

- `build_model(path, args)`: the factory at `path` is called with one dict (`args`); it must
  return an `nn.Module` with at least one trainable parameter and no empty ones. An exception
  from the factory is a `UserError` naming the factory, its arguments and the exception (the
  traceback is logged at debug level: `--log-level debug`).
- `split_output(out)`: `forward(x, y)` must return `(logits, loss)` with a one-element loss
  tensor. Checked on every call: a few isinstance checks, no device sync, no random numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.errors import UserError
from harness.models import call_factory, load_factory


def build_model(path: str, args: dict[str, Any], folder: Path | None = None) -> nn.Module:
    """Call the factory at `path` (its module looked for in `folder` too: load_factory) with `args`
    and check what it returns (see the module docstring)."""
    model = call_factory(load_factory(path, folder=folder), path, "model factory", "model.args", args, dict(args))
    if not isinstance(model, nn.Module):
        raise UserError(f"model factory {path!r} returned a {type(model).__name__}, not a torch.nn.Module; "
                        "it must build and return the model (docs/models.md)")
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise UserError(f"model factory {path!r} returned a {type(model).__name__} without trainable "
                        "parameters: there is nothing to train; check model.args and the factory")
    empty = [f"{name} {tuple(p.shape)}" for name, p in params if p.numel() == 0]
    if empty:
        raise UserError(f"model factory {path!r}: parameter(s) with no elements: {', '.join(empty)}; "
                        f"a width or size in model.args is 0 ({args})")
    return model


def split_output(out: Any) -> tuple[Any, torch.Tensor]:
    """`(logits, loss)` from what `forward(x, y)` returned; UserError if it is not that shape."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise UserError(f"the model's forward(x, y) returned {got}; it must return a pair (logits, loss) "
                        "with loss a scalar tensor (docs/models.md)")
    loss = out[1]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise UserError(f"the model's forward(x, y) returned (logits, {got}); the loss must be a scalar "
                        "tensor, e.g. F.cross_entropy(logits.flatten(0, 1), y.flatten()) (docs/models.md)")
    return out[0], loss
