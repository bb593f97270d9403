"""Exact elastic mode as the trainer decides and runs it, in one process (harness/run/trainer.py,
harness/run/exact_mode.py, harness/parallel/exact.py): a model whose forward updates buffers is
taken out of the mode by name ("auto") or refused (`true`), judged by one probe forward that
leaves no trace; and a parameter no micro-batch of a step uses keeps no gradient, so the
optimizers step the same parameters in the mode as outside it. Across ranks:
tests/distributed/test_exact_elastic.py."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_config
from harness.errors import UserError
from harness.repro.rng import RNGState
from harness.run.trainer import Trainer
from procs import ROOT

EXACT = ROOT / "tests" / "data" / "exact.toml"  # V = 4 micro-batches of 2, dropout 0.1, exact_elastic = true
TASKS = ROOT / "tests" / "task" / "tasks.toml"  # V = 2 micro-batches of 8
BATCH_NORM = ["model.norm.num_batches_tracked", "model.norm.running_mean", "model.norm.running_var"]


@pytest.fixture(autouse=True)
def _user_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # tests.user_models, tests.user_tasks


def gpt(factory: str, mode: str, *sets: str):
    return load_config(EXACT, [f'model.factory="tests.user_models:{factory}"', f"parallel.exact_elastic={mode}",
                               "train.device=cpu", *sets])


@pytest.mark.parametrize("factory, buffers", [("batch_norm_gpt", BATCH_NORM),
                                              ("counting_ema_gpt", ["model.forwards", "model.logit_ema"])])
def test_auto_trains_without_exact_mode_naming_the_buffers_the_forward_updates(factory, buffers):
    trainer = Trainer(gpt(factory, "auto"))
    try:
        assert not trainer.exact and trainer.cfg.parallel.exact_elastic is False
        assert trainer.exact_why == (f"auto: off, the model's forward updates buffers {', '.join(buffers)}, which "
                                     "each rank would update over its own micro-batches (no exact cross-rank "
                                     "reduction)")
        assert all(not torch.count_nonzero(b) for n, b in trainer.model.named_buffers() if "running_mean" in n)
    finally:
        trainer.close()


def test_exact_elastic_true_is_refused_naming_the_buffers():
    with pytest.raises(UserError, match=r"^parallel.exact_elastic = true, but the model's forward updates buffers "
                                        r"model.norm.num_batches_tracked, model.norm.running_mean, "
                                        r"model.norm.running_var, .*set parallel.exact_elastic = false"):
        Trainer(gpt("batch_norm_gpt", "true"))


def test_an_iterator_as_the_training_data_is_refused_before_any_probe():
    with pytest.raises(UserError, match=r"^parallel.exact_elastic needs a map-style dataset"):
        Trainer(gpt("batch_norm_gpt", "true", 'data.factory="tests.data.user_datasets:build_walk"'))


def test_the_probe_forward_leaves_the_generators_and_the_buffers_as_they_were():
    """A model with a buffer its forward rebuilds (not state) stays in exact mode; the probe
    forward it took (dropout on, the cache written) left every generator and buffer as a trainer
    without the mode has them."""
    exact = Trainer(gpt("cached_mask_gpt", "auto"))
    exact_rng = RNGState("cpu").state_dict()
    plain = Trainer(gpt("cached_mask_gpt", "false"))
    try:
        assert exact.exact and exact.exact_why == "auto: every precondition holds"
        assert not plain.exact
        plain_rng = RNGState("cpu").state_dict()
        assert torch.equal(exact_rng["torch"], plain_rng["torch"]) and exact_rng["python"] == plain_rng["python"]
        assert exact_rng.get("numpy") == plain_rng.get("numpy")
        assert not torch.count_nonzero(exact.model.mask)
        ours, theirs = exact.model.state_dict(), plain.model.state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    finally:
        exact.close()
        plain.close()


def test_a_parameter_without_a_gradient_is_stepped_by_no_optimizer_in_exact_mode_as_outside_it():
    """tests/user_tasks.py:partly_used, 6 steps at world size 1 with and without exact mode
    (V = 2: the tree and the accumulation add alike; no clipping): the same parameters and
    optimizer state, bit for bit; AdamW stepped the partly used matrix on its 3 even steps only
    (no decay, no momentum on the steps that gave it no gradient)."""
    trainers = [Trainer(load_config(TASKS, ['task.factory="tests.user_tasks:partly_used"', "train.grad_clip=inf",
                                            "optim.weight_decay=0.1", "train.steps=6",
                                            f"parallel.exact_elastic={mode}"]))
                for mode in ("true", "false")]
    try:
        assert [t.exact for t in trainers] == [True, False]
        for trainer in trainers:
            for _ in range(6):
                trainer.train_step()
        exact, plain = (t.model.state_dict() for t in trainers)
        assert all(torch.equal(exact[k], plain[k]) for k in plain), {k: (exact[k], plain[k]) for k in plain}
        for trainer in trainers:
            adamw = trainer.optim.optimizers["adamw"]
            assert int(adamw.state[trainer.model.extra]["step"]) == 3
            assert int(adamw.state[trainer.model.linear.weight]["step"]) == 6
        exact_state, plain_state = (t.optim.optimizers["adamw"].state_dict()["state"] for t in trainers)
        assert all(torch.equal(exact_state[i][k], plain_state[i][k]) for i in plain_state for k in plain_state[i])
    finally:
        for trainer in trainers:
            trainer.close()
