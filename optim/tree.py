"""What the bundles' loads share (optim/bundle.py, optim/schedulers.py): the plain trees they save,
how a built value is compared with a saved one, and the refusals of a state that does not fit.

A plain tree is dict/list/Tensor/int/float/str/bool/None, no tuples: it survives safetensors +
JSON unchanged, so a value saved and read back compares equal to `plain` of the value it was.
"""

from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias, overload

import torch

from optim.errors import OptimError

REFERENCE_FORMAT = ("it looks like the team reference's positional MultiOpt state (one torch state dict "
                    "per optimizer, in list order); this bundle loads only its own name-keyed state "
                    "(optim.bundle), so resume from a checkpoint written by the harness")

# A checkpoint-safe tree (module docstring): what `plain` makes of a state.
Tree: TypeAlias = "torch.Tensor | bool | int | float | str | None | list[Tree] | dict[str, Tree]"

# What a load found built otherwise than saved: "name/hyperparameter" -> (saved value, built value).
Changes: TypeAlias = dict[str, tuple[Any, Any]]


@overload
def plain(value: Mapping[str, object], where: str) -> dict[str, Tree]: ...
@overload
def plain(value: object, where: str) -> Tree: ...
def plain(value: object, where: str) -> Tree:
    """`value` as a checkpoint-safe tree (tuples become lists, a Counter a dict); anything else is a bug."""
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint cannot hold")


def same(saved: Any, built: Any) -> bool:  # any two values a state holds
    """Whether a value read from a checkpoint is `built` (a live value, compared as `plain` makes it):
    tensors by dtype, shape and every element, containers entry by entry, the rest by `==`."""
    built = plain(built, "value")
    if isinstance(saved, torch.Tensor) or isinstance(built, torch.Tensor):
        return (isinstance(saved, torch.Tensor) and isinstance(built, torch.Tensor) and saved.dtype == built.dtype
                and saved.shape == built.shape and torch.equal(saved.cpu(), built.cpu()))
    if isinstance(saved, list) and isinstance(built, list):
        return len(saved) == len(built) and all(same(a, b) for a, b in zip(saved, built, strict=True))
    if isinstance(saved, dict) and isinstance(built, dict):
        return saved.keys() == built.keys() and all(same(saved[k], built[k]) for k in saved)
    return bool(saved == built)


def refuse_mismatch(kind: str, where: str, saved: Iterable[str], current: Iterable[str]) -> None:
    missing, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing:
        raise OptimError(f"checkpoint {where} lacks {kind} {missing[0]!r} (missing: {missing}); "
                        "resume with the config the checkpoint was written with")
    if extra:
        raise OptimError(f"checkpoint {where} has {kind} {extra[0]!r} that this run does not "
                        f"(extra: {extra}); resume with the config the checkpoint was written with")


def malformed(where: str, what: str) -> OptimError:
    return OptimError(f"checkpoint {where} is malformed: {what}; it was not written by this harness's optimizer bundle")


def require(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise malformed(where, what)
