"""Non-persistent buffers that carry state from step to step, found by watching one forward.

A checkpoint holds a module's `state_dict`: parameters and persistent buffers. A non-persistent
buffer (`register_buffer(name, t, persistent=False)`) is left out, which is right for a cache
that forward rebuilds before reading it (a causal mask, rotary tables) and for a constant, and
wrong for state that forward reads and then updates (an EMA, a running statistic): a resumed run
starts that from its initial value. Nothing declares which is which, so `BufferProbe` watches a
forward through a TorchDispatchMode and names each non-persistent buffer that an operator reads
before any operator has overwritten all of it, and that is written in the same forward.

What counts: an operator that mutates an argument (`Tensor(a!)` in its schema) writes it, and
overwrites the whole buffer only when it is one of `_OVERWRITES` or an `out=` argument and the
tensor spans the whole buffer; any other mutation (`mul_`, `lerp_`, `index_put_`) keeps part of
the old value, so it reads it too. View operators and `*_like` / `new_*` (which take only a
shape) read nothing; every other operator taking the buffer reads it. Tensors are matched to
buffers by storage, so a view of a buffer is the buffer.

Cost: Python for each operator of one forward, once per process (the trainer's first step, or
the first step of each build in `harness.testing`);
every operator runs exactly as it would, so the numbers do not change.
"""

from __future__ import annotations

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


class BufferProbe:
    """Watch the next forward of `module` (after any wrapper's own work, e.g. DDP's buffer
    broadcast); `stateful` then lists the non-persistent buffers that carry state, in name order,
    as "PART.NAME" (`part`: the module's state part name)."""

    def __init__(self, module: torch.nn.Module, part: str = "model") -> None:
        self.part = part
        self._mode = _Watch(non_persistent_buffers(module))
        self._done = False
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit, always_call=True)]

    @property
    def done(self) -> bool:
        return self._done

    @property
    def stateful(self) -> list[str]:
        m = self._mode
        return [f"{self.part}.{name}" for name in sorted(m.read_first & (m.written | m.mutated))]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._mode.__enter__()

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._mode.__exit__(None, None, None)
        self._done = True
        for handle in self._handles:
            handle.remove()


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
