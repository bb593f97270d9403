"""Non-persistent buffers and exact resume, with a user's model factory (tests/user_models.py) in
real `harness train` processes: a cache that forward rebuilds raises no alarm; state kept in one
is refused before the first step, and named when the run goes on anyway; the same for a task
checked in-process with `harness.testing.check_resume`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from harness.cli import main
from harness.repro.completeness import IncompleteState
from harness.testing import Task, check_resume
from procs import TINY, assert_one_line_error, harness

CACHED_MASK = 'model.factory="tests.user_models:cached_mask_gpt"'
LOSS_EMA = 'model.factory="tests.user_models:loss_ema_gpt"'


def verify_resume(capsys, work: Path, *sets: str) -> tuple[int, str]:
    args = ["verify-resume", str(TINY), "--interrupt-at", "6", "--signal", "KILL", "--work-dir", str(work)]
    code = main([*args, *(x for s in sets for x in ("--set", s))])
    return code, capsys.readouterr().out


def test_a_cache_rebuilt_by_forward_is_no_divergence(capsys, tmp_path):
    code, out = verify_resume(capsys, tmp_path, CACHED_MASK)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("identical: 12 steps")
    assert "reported" not in out  # B's resumed process raised no resume_mismatch


def test_state_in_a_non_persistent_buffer_is_refused_before_the_first_step(tmp_path):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--set", LOSS_EMA)
    assert_one_line_error(proc, "non-persistent buffers carry state across steps: model.loss_ema (forward reads")
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_state_in_a_non_persistent_buffer_is_named_when_the_resume_diverges(capsys, tmp_path):
    code, out = verify_resume(capsys, tmp_path, LOSS_EMA, 'train.unregistered_state="warn"')
    assert code == 1, out
    assert "diverged at step 5: part model, tensor model.loss_ema; hint: non-persistent buffer model.loss_ema" in out


class EmaNet(nn.Module):
    """A user's model for `harness.testing`: its loss EMA lives in a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("loss_ema", torch.zeros(()), persistent=False)

    def forward(self, batch: dict) -> torch.Tensor:
        loss = (self.lin(batch["x"]) - batch["y"]).pow(2).mean()
        self.loss_ema.lerp_(loss.detach(), 0.1)
        return loss + 0.01 * self.loss_ema


class Batches:
    """Batch k: samples 4k .. 4k+3 of a fixed table; the cursor is the state."""

    table = torch.randn(32, 5, generator=torch.Generator().manual_seed(1))

    def __init__(self) -> None:
        self.position = 0

    def __next__(self) -> dict:
        ids = (torch.arange(4) + 4 * self.position) % len(self.table)
        self.position += 1
        return {"x": self.table[ids, :4], "y": self.table[ids, 4:], "sample_ids": ids}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def build_ema_task() -> Task:
    model = EmaNet()
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=Batches())


def test_check_resume_refuses_then_names_a_stateful_non_persistent_buffer():
    with pytest.raises(IncompleteState, match=r"non-persistent buffers carry state across steps: model\.loss_ema"):
        check_resume(build_ema_task, steps=6, interrupt_at=[3])
    verdict = check_resume(build_ema_task, steps=6, interrupt_at=[3], unregistered="warn")
    assert (verdict.step, verdict.part, verdict.tensor) == (4, "model", "model.loss_ema"), str(verdict)
    assert "non-persistent buffer model.loss_ema carries state" in verdict.hint
