"""The finite-state check before a save (harness/repro/finite.py, through Trainer.check_finite_state):
however many tensors the state has, no tensor's sum is moved to another device and the host waits
once. On a GPU a sum moved to the training device was a copy and a wait per CPU-resident tensor
(AdamW's `step` counters); counted here on the CPU, where every such move still shows as a call."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from harness.config import load_config
from harness.run.trainer import Trainer, TrainingDiverged
from procs import TINY


class Counted(TorchFunctionMode):
    """Counts the tensor functions called inside it by name (`to`: a move between devices;
    `__bool__`: a wait for the device's result)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def test_the_check_moves_no_tensor_and_waits_once_however_many_tensors(tmp_path):
    trainer = Trainer(load_config(TINY, [f"run_dir={str(tmp_path)!r}", "train.device=cpu"]))
    trainer.train_step()  # AdamW's state: moments and a `step` counter per parameter
    tensors = sum(1 for _ in trainer.model.parameters()) * 4
    assert tensors > 20
    with Counted() as counted:
        trainer.check_finite_state()
    assert counted.calls["to"] <= 1 and counted.calls["__bool__"] == 1, counted.calls
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(TrainingDiverged, match=f"model/{name} holds NaN/inf after step 1"):
        trainer.check_finite_state()
    trainer.close()


def test_every_device_reduces_its_own_tensors_to_one_flag():
    from harness.repro.finite import first_nonfinite

    named = [("a", torch.ones(3)), ("b", torch.ones(2, dtype=torch.float64)), ("c", torch.tensor(4.0))]
    with Counted() as counted:
        assert first_nonfinite(named) is None
    assert counted.calls["stack"] == 2 and counted.calls["__bool__"] == 1  # the sums' stack, the flags'
    assert first_nonfinite([*named, ("d", torch.tensor([1.0, float("inf")]))]) == "d"
    assert first_nonfinite([("big", torch.full((4,), 3e38))]) is None  # a sum that overflows is checked exactly
    assert first_nonfinite([]) is None
