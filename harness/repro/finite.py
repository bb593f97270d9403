"""The finite-state check before a save: whether a tensor of the state holds NaN/inf (`first_nonfinite`),
at the price of one reduction per tensor where it lies and one host sync in all.

Why grouped by device: a state on a GPU keeps some tensors on the host (AdamW's `step` counters, a
task's CPU buffers). Moving each tensor's sum to the training device, as this check once did, was a
host-to-device copy and a wait per such tensor; here each device reduces its own tensors' sums to
one flag, and only the flags meet on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.repro.on_cores import host_bytes, on_cores


def first_nonfinite(named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor of `named` (dense floating tensors: a DTensor's local shard)
    holding NaN/inf, or None when none does.

    Cheap: one float32 sum per tensor (a NaN/inf element makes it non-finite; one fused reduction,
    about 60x faster on a CPU than `isfinite().all()`), host tensors summed on every core for a
    large state (the step loop waits for this pass: repro/on_cores.py), a GPU's by kernels queued
    without a wait; one flag per device, and one host sync for all of them. Only when a sum is not
    finite (or overflowed) is each tensor checked exactly, to name it."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in named:
        by_device.setdefault(t.device, []).append(t)
    flags = []
    for device, tensors in by_device.items():
        if device.type == "cpu":
            sums = on_cores(lambda t: t.sum(dtype=torch.float32), tensors, host_bytes(tensors),
                            each_uses=torch.get_num_threads())
        else:
            sums = [t.sum(dtype=torch.float32) for t in tensors]
        flags.append(torch.stack(sums).isfinite().all())
    if not flags:
        return None
    meet = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
    if bool(torch.stack([f.to(meet, non_blocking=True) for f in flags]).all()):
        return None
    return next((n for n, t in named if not bool(t.isfinite().all())), None)
