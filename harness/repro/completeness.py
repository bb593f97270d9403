"""The completeness check: stateful objects the training code can reach that no state part saves.

A resume is exact only if every object whose state changes during training is in the checkpoint.
Before the first step, `check_registered(roots, parts, policy)` walks the objects reachable from
`roots` (the trainer, or a `harness.testing.Task`) through attributes, lists, tuples and dict
values (`MAX_DEPTH` levels, and the whole module tree of every `nn.Module`), and reports each
*stateful* object that is not *covered*:

- stateful: a torch optimizer, LR scheduler, grad scaler or `torch.Generator`, a `random.Random`,
  a numpy `Generator`/`RandomState`, or any object with `state_dict` and `load_state_dict`;
- covered: a registered part itself (by identity); what a registered part holds (a registered
  part owns its insides: its `state_dict` is trusted to hold them) -- except an `nn.Module`,
  whose `state_dict` is known to hold only parameters and buffers, so a module's other attributes
  (a `torch.Generator` its dropout draws from) are still looked at; a module whose parameters and
  buffers all belong to registered modules (a submodule, a DDP or compile wrapper) or that has none; what a
  registered part lists in `saved_members` (objects its `state_dict` holds the state of: the
  user's data iterator in the `data` part), wherever else it is reachable from; the process's
  default generators (python, numpy, torch CPU/CUDA) when an `RNGState` part is registered.

So the data stream's generators and prefetch iterators belong to the registered `data` part and
are not reported; an extra optimizer kept next to the bundle, an unregistered scheduler, a
GradScaler, a stateful dataset or a generator held by an unregistered data iterator are.
The policy is "error" (raise `UserError` naming them) or "warn" (log them).

Non-persistent buffers are a module's own, so the walk cannot judge them: a cache rebuilt by
forward is fine, an EMA kept in one is lost on resume. `check_buffers` applies the same policy to
the ones `harness.repro.buffer_probe` finds carrying state while watching the trainer's first forward
(before any optimizer step).
"""

from __future__ import annotations

import random
import types
from collections.abc import Mapping
from typing import Any

import torch

from harness.errors import UserError
from harness.log import get_logger
from harness.repro.rng import RNGState

log = get_logger(__name__)

MAX_DEPTH = 4
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.device, torch.dtype, type,
               types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, range)

np: types.ModuleType | None
try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None
_NUMPY_RNG: tuple[type, ...] = () if np is None else (np.random.Generator, np.random.RandomState)

_Config: type | tuple[type, ...]
try:
    from pydantic import BaseModel as _Config
except ImportError:  # pragma: no cover - pydantic is a dependency of the config
    _Config = ()


class IncompleteState(UserError):
    """Stateful objects reachable from the training code are not registered state parts."""


def is_stateful(obj: Any) -> bool:
    if isinstance(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler,
                        torch.Generator, random.Random, *_NUMPY_RNG)):
        return True
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _covered(parts: Mapping[str, Any]) -> set[int]:
    ids = {id(p) for p in parts.values()}
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            ids.update(map(id, part.modules()))
            ids.update(map(id, part.parameters()))
            ids.update(map(id, part.buffers()))
        for members in (getattr(part, "optimizers", None), getattr(part, "schedulers", None)):
            if isinstance(members, Mapping):
                ids.update(map(id, members.values()))
        ids.update(map(id, getattr(part, "saved_members", ())))
        if isinstance(part, RNGState):
            ids.update({id(torch.default_generator), id(random._inst)})
            if torch.cuda.is_available():
                ids.update(map(id, torch.cuda.default_generators))
            if np is not None:
                ids.add(id(np.random.mtrand._rand))
    return ids


def find_unregistered(roots: Mapping[str, Any], parts: Mapping[str, Any]) -> list[str]:
    """'path (type)' of every stateful object reachable from `roots` that `parts` does not cover."""
    walk = _Walk(_covered(parts))
    for name, root in roots.items():
        walk.visit(root, name, 0)
    for name, part in parts.items():
        walk.visit(part, name, 0)
    return walk.found


class _Walk:
    """One walk of `find_unregistered`: each object is visited once (by identity), whichever root
    reaches it first; `found` lists the stateful ones `covered` (ids) does not hold, in the order met."""

    def __init__(self, covered: set[int]) -> None:
        self.covered = covered
        self.seen: set[int] = set()
        self.found: list[str] = []

    def visit(self, obj: Any, path: str, depth: int) -> None:
        """Look at `obj`, reached through `path` at `depth` levels below its root, and what it holds."""
        if isinstance(obj, _LEAF_TYPES) or isinstance(obj, _Config) or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            self._module(obj, path, depth)
        elif is_stateful(obj):
            # A registered part owns its insides; an unregistered one is reported once.
            if id(obj) not in self.covered:
                self.found.append(f"{path} ({type(obj).__name__})")
        elif depth < MAX_DEPTH:
            self._members(obj, path, depth)

    def _module_covered(self, m: torch.nn.Module) -> bool:
        """Whether state parts save `m`'s parameters and buffers: `m` is covered itself, or each of
        its tensors is."""
        # A module without parameters or buffers (a stateless wrapper such as the kernel
        # dispatchers transformers keeps in a plain dict) has nothing a state dict would save;
        # its other attributes are still walked.
        return id(m) in self.covered or all(id(t) in self.covered for t in (*m.parameters(), *m.buffers()))

    def _module(self, m: torch.nn.Module, path: str, depth: int) -> None:
        """A module no part covers is reported, not entered; a covered one's whole module tree is
        seen, and the attributes of each submodule other than its parameters, buffers and
        submodules (what its state dict does not hold) are visited."""
        if not self._module_covered(m):
            self.found.append(f"{path} ({type(m).__name__}, parameters no state part saves)")
            return
        for name, sub in m.named_modules():
            self.seen.add(id(sub))
            for attr, value in vars(sub).items():
                if attr not in _MODULE_INTERNALS:
                    self.visit(value, ".".join(filter(None, (path, name, attr))), depth + 1)

    def _members(self, obj: Any, path: str, depth: int) -> None:
        """Visit what a stateless `obj` holds: a mapping's values, a list's, tuple's or set's
        items, another object's attributes."""
        if isinstance(obj, Mapping):
            for key, value in list(obj.items()):
                self.visit(value, f"{path}[{key!r}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, value in enumerate(obj):
                self.visit(value, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__"):
            for attr, value in list(vars(obj).items()):
                self.visit(value, f"{path}.{attr}", depth + 1)


def check_registered(roots: Mapping[str, Any], parts: Mapping[str, Any], policy: str = "error") -> list[str]:
    """Raise `IncompleteState` (policy "error") or log a warning ("warn") naming every stateful
    object reachable from `roots` or inside a registered module that `parts` does not cover;
    returns them."""
    found = find_unregistered(roots, parts)
    if not found:
        return found
    message = (f"stateful objects reachable from the training code are not registered state parts, so a "
               f"checkpoint would not hold them and a resume would not be exact: {', '.join(found)}. Register "
               f"each as a state part, or set train.unregistered_state = \"warn\" to train anyway")
    if policy == "error":
        raise IncompleteState(message)
    log.warning("unregistered state", objects=found)
    return found


def check_buffers(stateful: list[str], policy: str = "error") -> None:
    """Raise `IncompleteState` (policy "error") or log ("warn") naming the non-persistent buffers
    found to carry state across steps (`harness.repro.buffer_probe`, at the first forward)."""
    if not stateful:
        return
    message = (f"non-persistent buffers carry state across steps: {', '.join(stateful)} (forward reads each "
               f"before writing it), but a checkpoint holds no non-persistent buffer, so a resume would not be "
               f"exact. Register each with persistent=True, or rebuild it in forward before reading it, or set "
               f"train.unregistered_state = \"warn\" to train anyway")
    if policy == "error":
        raise IncompleteState(message)
    log.warning("non-persistent buffers carry state", buffers=stateful)
