"""The task contract's refusals (one line each, naming the key or the method, nothing written) and
the one path `harness.testing` and `harness train` share."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoint import CheckpointStore, load
from harness.config import load_config
from harness.repro.completeness import IncompleteState
from harness.run.trainer import Trainer
from harness.task import SeededSamples
from harness.testing import assert_resumes_exactly, trainer_task
from procs import ENV, ROOT, assert_one_line_error, harness, losses

TASKS = ROOT / "tests" / "task" / "tasks.toml"
EXAMPLES = ROOT / "examples"


def train(tmp_path, *sets: str):
    args = [a for s in sets for a in ("--set", s)]
    return harness("train", str(TASKS), "--run-dir", str(tmp_path / "run"), *args)


@pytest.mark.parametrize("factory, message", [
    ("no_models", "has no models method; a task needs models(ctx), data(ctx) and loss(models, batch) or step("),
    ("no_loss", "has no loss (or step) method"),
    ("takes_a_name", "state() names a part 'model', which is the harness's own"),
    ("broken", "task factory 'tests.task.bad_tasks:broken' failed with task args {}: RuntimeError: no such dataset"),
    ("missing", "'tests.task.bad_tasks' has no attribute 'missing'"),
    ("foreign_bundle", "optimizers() returned its optimizers as a PositionalMultiOpt (from tests.task.bad_tasks); "
                       "return {name: optimizer} (or optim.MultiOpt)"),
    ("schedules_another", "scheduler 'a' drives another optimizer than 'a'"),
])
def test_a_task_that_breaks_the_contract_is_one_line_naming_what(tmp_path, factory, message):
    proc = train(tmp_path, f"task.factory='tests.task.bad_tasks:{factory}'")
    assert_one_line_error(proc, message)
    assert not (tmp_path / "run").exists()  # nothing written, not even an empty run dir


@pytest.mark.parametrize("setting, message", [
    ("model.args={n_layer=2}", "model.args = { n_layer = 2 } takes effect only with the built-in language model "
                               '(task.factory unset), but task.factory = "tests.task.bad_tasks:build" builds its own'),
    ("data.seq_len=32", "data.seq_len = 32 takes effect only with the built-in language model"),
])
def test_a_language_model_key_beside_a_task_factory_is_refused_naming_it(tmp_path, setting, message):
    assert_one_line_error(train(tmp_path, setting), message)


def test_optim_beside_a_task_with_its_own_optimizers_is_refused(tmp_path):
    proc = harness("train", str(EXAMPLES / "two_cadences.toml"), "--run-dir", str(tmp_path / "run"), "--set",
                   "optim.lr=0.1", env={**ENV, "PYTHONPATH": str(EXAMPLES)})
    assert_one_line_error(proc, "[optim] is set, but task 'two_cadences:build' builds its own optimizers")


def test_micro_batches_of_one_step_that_step_different_optimizers_are_refused(tmp_path):
    proc = train(tmp_path, "task.factory='tests.task.bad_tasks:undecided'")
    assert_one_line_error(proc, "every micro-batch of a step must step the same optimizers")


def test_state_the_task_keeps_outside_its_parts_is_refused_at_start(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    cfg = load_config(TASKS, ["task.factory='tests.task.bad_tasks:forgets_its_ema'"])
    with pytest.raises(IncompleteState, match=r"trainer\.task\.task\.ema \(Linear, parameters no state part"):
        Trainer(cfg)


def test_harness_testing_and_harness_train_share_the_step_bit_for_bit(tmp_path, monkeypatch):
    """The distillation example (two models, an EMA as extra state) through `harness.testing`: it
    resumes exactly in-process; and the same step, run by `harness train`, logs the same loss at
    every step and ends with the same model and EMA tensors."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    steps = 6
    sets = [f"train.steps={steps}", "train.eval_every=0"]
    cfg = load_config(EXAMPLES / "distillation.toml", sets)
    assert_resumes_exactly(lambda: trainer_task(cfg), steps=steps, interrupt_at=[2, 4], workdir=tmp_path)

    run_dir = tmp_path / "run"
    harness("train", str(EXAMPLES / "distillation.toml"), "--run-dir", str(run_dir),
            *[a for s in sets for a in ("--set", s)], env={**ENV, "PYTHONPATH": str(EXAMPLES)}, check=True)
    task = trainer_task(cfg)
    trainer = task.extras["trainer"]
    in_process = [task.run_step()[0] for _ in range(steps)]
    assert in_process == [losses(run_dir)[s] for s in range(1, steps + 1)]
    store = CheckpointStore(str(run_dir))
    saved = store.open(store.ref(steps))
    trainer_b = Trainer(cfg)
    load(store, saved, trainer_b.state.parts())
    for part in ("model", "ema"):
        live, loaded = trainer.state.parts()[part].state_dict(), trainer_b.state.parts()[part].state_dict()
        assert all(torch.equal(live[k], loaded[k]) for k in live), part
    trainer.close()
    trainer_b.close()


def test_seeded_samples_draw_each_sample_from_its_own_seed_whatever_the_order():
    draw = lambda g: torch.randn(3, generator=g)  # noqa: E731
    forward = SeededSamples(5, seed=7, draw=draw)
    backward = [SeededSamples(5, seed=7, draw=draw)[i] for i in reversed(range(5))][::-1]
    assert len(forward) == 5
    assert all(torch.equal(forward[i], backward[i]) for i in range(5))
    assert not torch.equal(forward[0], SeededSamples(5, seed=8, draw=draw)[0])  # another seed, other samples
    assert not torch.equal(forward[0], forward[1])
    with pytest.raises(IndexError):
        forward[5]
