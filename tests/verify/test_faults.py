"""Planted resume faults, one test each: `harness.testing.check_resume` must name the first
divergent step and the part to blame. The model, data and optimizer are defined here, the way a
user's own test would define them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.repro.completeness import IncompleteState
from harness.testing import Task, assert_resumes_exactly, check_resume

STEPS, CUT = 10, 4  # interrupted after step 4: step 5 is the first resumed step


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        return F.mse_loss(self.body(batch["x"]), batch["y"])


DATA = torch.randn(64, 9, generator=torch.Generator().manual_seed(7))


class Batches:
    """Seekable batches: batch k holds samples (8k .. 8k+7) mod 64; the cursor is the state."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        ids = (torch.arange(8) + 8 * self.position) % len(DATA)
        self.position += 1
        return self.batch(ids)

    @staticmethod
    def batch(ids: torch.Tensor) -> dict:
        return {"x": DATA[ids, :8], "y": DATA[ids, 8:], "sample_ids": ids}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class LateCursor(Batches):
    """Fault: the cursor comes back one batch late."""

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"] + 1


class SampledBatches(Batches):
    """Draws each batch's samples from its own generator; only the cursor is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)

    def __next__(self) -> dict:
        self.position += 1
        return self.batch(torch.randint(len(DATA), (8,), generator=self.generator))


class SampledIterator:
    """Like SampledBatches, but a plain iterator with no state of its own to save."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(3)

    def __next__(self) -> dict:
        return Batches.batch(torch.randint(len(DATA), (8,), generator=self.generator))


class ForgetfulSGD(torch.optim.SGD):
    """Fault: the momentum buffers are left out of the state dict."""

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["state"] = {k: {n: v for n, v in s.items() if n != "momentum_buffer"} for k, s in state["state"].items()}
        return state


def build(*, data=Batches, optimizer=None, parts: tuple[str, ...] = ("model", "optim", "sched", "data", "rng")) -> Task:
    model = TinyNet()
    opt = (optimizer or torch.optim.AdamW)(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20)
    task = Task(model=model, optimizer=opt, data=data(), scheduler=sched)
    task.state = {k: v for k, v in task.parts().items() if k in parts}
    return task


def test_identical_when_everything_is_registered():
    verdict = assert_resumes_exactly(build, steps=STEPS, interrupt_at=[3, CUT, 7])
    assert "identical" in str(verdict)


def test_scheduler_not_saved():
    with pytest.raises(IncompleteState, match=r"task\.scheduler \(LambdaLR\)"):
        check_resume(lambda: build(parts=("model", "optim", "data", "rng")), steps=STEPS, interrupt_at=[CUT])
    verdict = check_resume(lambda: build(parts=("model", "optim", "data", "rng")), steps=STEPS, interrupt_at=[CUT],
                           unregistered="warn")
    assert (verdict.step, verdict.part) == (CUT + 1, "sched"), str(verdict)
    assert "lr" in verdict.fields and "scheduler" in verdict.hint


def test_data_generator_not_registered():
    verdict = check_resume(lambda: build(data=SampledBatches), steps=STEPS, interrupt_at=[CUT])
    assert (verdict.step, verdict.part) == (CUT + 1, "data"), str(verdict)
    assert "generator" in verdict.hint


def test_completeness_names_a_generator_of_an_unregistered_data_iterator():
    with pytest.raises(IncompleteState, match=r"task\.data\.generator \(Generator\)"):
        check_resume(lambda: build(data=SampledIterator), steps=STEPS, interrupt_at=[CUT])
    verdict = check_resume(lambda: build(data=SampledIterator), steps=STEPS, interrupt_at=[CUT], unregistered="warn")
    assert (verdict.step, verdict.part) == (CUT + 1, "data"), str(verdict)


def test_dropout_rng_not_restored():
    verdict = check_resume(lambda: build(parts=("model", "optim", "sched", "data")), steps=STEPS, interrupt_at=[CUT])
    assert (verdict.step, verdict.part) == (CUT + 1, "rng"), str(verdict)
    assert "loss" in verdict.fields and "batch" not in verdict.fields and "lr" not in verdict.fields
    assert "dropout" in verdict.hint


def test_data_cursor_off_by_one():
    verdict = check_resume(lambda: build(data=LateCursor), steps=STEPS, interrupt_at=[CUT])
    found = (verdict.step, verdict.when, verdict.part, verdict.tensor)
    assert found == (CUT, "restore", "data", "position"), str(verdict)


def test_optimizer_buffer_left_out():
    verdict = check_resume(lambda: build(optimizer=lambda p, lr: ForgetfulSGD(p, lr=lr, momentum=0.9)),
                           steps=STEPS, interrupt_at=[CUT])
    assert (verdict.step, verdict.when, verdict.part) == (CUT, "restore", "optim"), str(verdict)
    assert re.fullmatch(r"state/body\.\d\.(weight|bias)/momentum_buffer", verdict.tensor), str(verdict)
    assert "only before saving" in str(verdict)


def test_verdict_names_the_tensor_and_its_difference():
    """The RNG is not saved, so the tensor named is where its effect at the step is largest."""
    verdict = check_resume(lambda: build(parts=("model", "optim", "sched", "data")), steps=STEPS, interrupt_at=[CUT])
    assert re.match(r"(model|optim)\.safetensors:", verdict.tensor) and verdict.max_diff > 0, str(verdict)
    assert str(verdict).startswith(f"diverged at step {CUT + 1}: part rng, tensor {verdict.tensor}, max |diff| ")
