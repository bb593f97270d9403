"""`harness.testing` on the project's own trainer (the quickstart model), and the completeness
check on the built-in trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.repro.completeness import IncompleteState, check_registered, find_unregistered
from harness.run.trainer import Trainer
from harness.testing import assert_resumes_exactly, trainer_task

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


def test_a_module_without_tensors_in_a_plain_dict_is_walked_not_reported():
    """transformers >= 5.25 keeps parameterless kernel-dispatch modules in a plain dict on each
    attention layer: they have nothing a state dict would save, but what they hold is still looked at."""
    trainer = Trainer(quickstart())
    try:
        trainer.model._kernel_funcs = {"rotary": torch.nn.Identity()}
        assert find_unregistered({"trainer": trainer}, trainer.state.parts()) == []
        trainer.model._kernel_funcs["rotary"].gen = torch.Generator()
        trainer.model._kernel_funcs["scaled"] = torch.nn.Linear(2, 2)
        found = find_unregistered({"trainer": trainer}, trainer.state.parts())
        assert found == ["trainer.model._kernel_funcs['rotary'].gen (Generator)",
                         "trainer.model._kernel_funcs['scaled'] (Linear, parameters no state part saves)"]
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
