"""`harness.testing` on the project's own trainer (the quickstart model), and the completeness
check on the built-in trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.completeness import IncompleteState, check_registered, find_unregistered
from harness.config import load_config
from harness.testing import assert_resumes_exactly, trainer_task
from harness.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# The quickstart model and optimizer arm (muon + adamw, warmup-cosine schedules), shortened.
QUICKSTART = ["train.steps=8", "data.batch_size=2", "data.seq_len=32", "model.args.seq_len=32",
              "model.args.n_layer=2", "train.eval_batches=1", "optim.warmup=2"]


def quickstart(*extra: str):
    return load_config(ROOT / "configs" / "quickstart.toml", [*QUICKSTART, *extra])


def test_quickstart_trainer_resumes_exactly(tmp_path):
    cfg = quickstart()
    assert_resumes_exactly(lambda: trainer_task(cfg), steps=8, interrupt_at=[3, 5], workdir=tmp_path)


def test_builtin_trainer_registers_everything():
    trainer = Trainer(quickstart())
    try:
        assert find_unregistered({"trainer": trainer}, trainer.state.parts()) == []
        trainer.extra_optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
        trainer.scheduler = torch.optim.lr_scheduler.StepLR(trainer.extra_optimizer, 1)
        trainer.loaders = [{"gen": torch.Generator()}]
        with pytest.raises(IncompleteState) as e:
            check_registered({"trainer": trainer}, trainer.state.parts())
        for name in ("trainer.extra_optimizer (SGD)", "trainer.scheduler (StepLR)",
                     "trainer.loaders[0]['gen'] (Generator)"):
            assert name in str(e.value)
        assert "train.unregistered_state" in str(e.value)
        assert len(check_registered({"trainer": trainer}, trainer.state.parts(), "warn")) == 3
    finally:
        trainer.close()


def test_generator_inside_a_registered_model_is_reported():
    """A module's state_dict holds parameters and buffers only: its own generator is not saved."""
    trainer = Trainer(quickstart())
    try:
        trainer.model.blocks_rng = torch.Generator()
        found = find_unregistered({"trainer": trainer}, trainer.state.parts())
        assert found == ["trainer.model.blocks_rng (Generator)"]
    finally:
        trainer.close()


def test_trainer_refuses_unregistered_state_by_config():
    class WithScaler(Trainer):
        def __init__(self, cfg):
            self.second_scaler = torch.amp.GradScaler("cpu", enabled=False)
            super().__init__(cfg)

    with pytest.raises(IncompleteState, match=r"trainer\.second_scaler \(GradScaler\)"):
        WithScaler(quickstart())
    WithScaler(quickstart('train.unregistered_state="warn"')).close()
