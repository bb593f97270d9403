"""Buffers that carry state from one forward to the next, found by watching a forward.

A checkpoint holds a module's `state_dict`: parameters and persistent buffers. A non-persistent
buffer (`register_buffer(name, t, persistent=False)`) is left out, which is right for a cache
that forward rebuilds before reading it (a causal mask, rotary tables) and for a constant, and
wrong for state that forward reads and then updates (an EMA, a running statistic): a resumed run
starts that from its initial value. Nothing declares which is which, so `BufferProbe` watches a
forward and names each non-persistent buffer that carries state. Exact elastic mode needs the
same answer for every buffer, persistent ones included (batch-norm statistics, an EMA, a
counter): a buffer a forward updates is updated by each rank over its own micro-batches, which
no cross-rank reduction of gradients makes the same at every world size; `updated_buffers`
runs one forward for it and puts every buffer back (harness/run/exact_mode.py).

`BufferWatch` is the one mechanism: a TorchDispatchMode names each watched buffer that an
operator reads before any operator has overwritten all of it, and that the same forward then
changes. An operator that mutates an argument (`Tensor(a!)` in its schema) writes it, and
overwrites the whole buffer only when it is one of `_OVERWRITES` or an `out=` argument and the
tensor spans the whole buffer; any other mutation (`mul_`, `lerp_`, `index_put_`) keeps part of
the old value, so it reads it too. Not every operator declares its writes (`native_batch_norm`
updates its running statistics through arguments its schema calls read-only), so a buffer whose
bits differ after the forward changed too, and so did one replaced (the module's attribute then
holds another tensor: `self.ema = 0.9 * self.ema + ...`). View operators and `*_like` / `new_*`
(which take only a shape) read nothing; every other operator taking the buffer reads it. Tensors
are matched to buffers by storage, so a view of a buffer is the buffer.

Cost: Python for each operator of the watched forward, and a copy of the watched buffers, once
per process (the trainer's first step, or the first step of each build in `harness.testing`; in
exact elastic mode one more forward at the start of a model with buffers); every operator runs
exactly as it would, so the numbers do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_OVERWRITES = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_",
                         "bernoulli_", "cauchy_", "geometric_", "log_normal_"})


def non_persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name (as in `named_buffers`) -> tensor of every buffer `module.state_dict()` leaves out."""
    out = {}
    for prefix, sub in module.named_modules():
        for name in sub._non_persistent_buffers_set:
            tensor = sub._buffers.get(name)
            if tensor is not None:
                out[f"{prefix}.{name}" if prefix else name] = tensor
    return out


class BufferWatch:
    """Within `with`: which of `buffers` (name, as `named_buffers` gives it, -> tensor) of `module`
    carry state (`carrying`, in name order): read by an operator before any operator overwrote
    all of it, and written, mutated, replaced or changed in the same block (module docstring).
    `put_back` restores every watched buffer as it was on entry."""

    def __init__(self, module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
        self._module = module
        self._buffers = buffers
        self._mode = _Watch(buffers)
        self._before: dict[str, torch.Tensor] = {}
        self._changed: set[str] = set()

    def __enter__(self) -> BufferWatch:
        self._before = {name: tensor.detach().clone() for name, tensor in self._buffers.items()}
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(None, None, None)
        now = dict(self._module.named_buffers(remove_duplicate=False))
        self._changed = {name for name, tensor in self._buffers.items()
                         if now.get(name) is not tensor or not _same_bits(tensor, self._before[name])}

    @property
    def carrying(self) -> list[str]:
        m = self._mode
        return sorted(m.read_first & (m.written | m.mutated | self._changed))

    @torch.no_grad()
    def put_back(self) -> None:
        """Every watched buffer as it was on entry: the same tensor in its module, its values."""
        for name, tensor in self._buffers.items():
            prefix, _, attr = name.rpartition(".")
            self._module.get_submodule(prefix)._buffers[attr] = tensor
            tensor.copy_(self._before[name])


class BufferProbe:
    """Watch the next forward of `module` (after any wrapper's own work, e.g. DDP's buffer
    broadcast); `stateful` then lists the non-persistent buffers that carry state, in name order,
    as "PART.NAME" (`part`: the module's state part name)."""

    def __init__(self, module: torch.nn.Module, part: str = "model") -> None:
        self.part = part
        self._watch = BufferWatch(module, non_persistent_buffers(module))
        self._done = False
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit, always_call=True)]

    @property
    def done(self) -> bool:
        return self._done

    @property
    def stateful(self) -> list[str]:
        return [f"{self.part}.{name}" for name in self._watch.carrying]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._watch.__enter__()

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._watch.__exit__()
        self._done = True
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def updated_buffers(module: torch.nn.Module, forward: Callable[[], object], part: str = "model") -> list[str]:
    """The buffers of `module`, persistent or not, that `forward()` (one forward of it, or of a
    step calling it) updates (`BufferWatch.carrying`), as "PART.NAME". Every buffer is put back as
    it was (the same tensor, its values before), so the call changes none; the caller keeps the
    random streams `forward` draws from. No forward at all for a module without buffers."""
    buffers = dict(module.named_buffers(remove_duplicate=False))
    if not buffers:
        return []
    watch = BufferWatch(module, buffers)
    try:
        with watch:
            forward()
    finally:
        watch.put_back()
    return [f"{part}.{name}" for name in watch.carrying]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` holds exactly `b`'s bits (a NaN equal to itself, -0.0 not to 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


class _Watch(TorchDispatchMode):
    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {b.untyped_storage().data_ptr(): n for n, b in buffers.items() if b.numel()}
        self.sizes = {n: b.numel() for n, b in buffers.items()}
        self.read_first: set[str] = set()
        self.written: set[str] = set()
        self.mutated: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not (func.is_view or name.endswith("_like") or name.startswith("new_")):
            self._observe(func, name, args, kwargs)
        return func(*args, **kwargs)

    def _observe(self, func, op: str, args: tuple, kwargs: dict) -> None:
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_leaves(value):
                buffer = self._buffer(t)
                if buffer is None:
                    continue
                writes = arg.alias_info is not None and arg.alias_info.is_write
                if writes and (arg.is_out or op in _OVERWRITES) and t.numel() == self.sizes[buffer]:
                    self.written.add(buffer)
                    continue
                if buffer not in self.written:
                    self.read_first.add(buffer)
                if writes:
                    self.mutated.add(buffer)

    def _buffer(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor) or not self.names:
            return None
        try:
            return self.names.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
            return None
