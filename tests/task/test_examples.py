"""The three task examples (docs/tasks.md) under every guarantee, each killed for real and compared
bit for bit with its uninterrupted run: an image classifier (a CNN on generated images, the
`[optim]` bundle, eval accuracy), two optimizers at their own cadences with their own schedulers
(a GAN's critic and generator, a whole step), a teacher-student distillation with an EMA (two
models, extra state). Each: SIGKILLed after step 7 with a local tier, resumed from its local step
6; and as two torchrun nodes that both die after step 7, node 1's disk gone, resumed by node 0's
process alone at world size 1 from its own local copy (written at world size 2): exact elastic
mode makes both the uninterrupted world-size-1 run bit for bit."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from launch import tail
from nodes import CADENCE, agents
from procs import ENV, ROOT, assert_same_run, events, harness, kill_at_step, losses
from test_spot_continuation import lose_all

EXAMPLES = ROOT / "examples"
ENV_EXAMPLES = {**ENV, "PYTHONPATH": str(EXAMPLES)}
STEPS = 12
SHORT = ("--set", f"train.steps={STEPS}", "--set", "train.eval_every=6")
NAMES = ["image_classifier", "two_cadences", "distillation"]
SLOW_STEPS = ("--set", "debug.step_sleep_s=0.5")


def train(name: str, run_dir, *extra: str) -> list[str]:
    return ["train", str(EXAMPLES / f"{name}.toml"), "--run-dir", str(run_dir), *SHORT, *CADENCE, *extra]


@pytest.fixture(scope="module", params=NAMES)
def example(request, tmp_path_factory):
    """(name, its uninterrupted run at world size 1)."""
    run_dir = tmp_path_factory.mktemp(f"{request.param}-uninterrupted")
    local = run_dir.parent / f"{run_dir.name}-local"  # the local tier does not change the math
    harness(*train(request.param, run_dir, "--set", f"checkpoint.local.dir='{local}'"), env=ENV_EXAMPLES, check=True)
    return request.param, run_dir


def test_the_example_trains_in_exact_elastic_mode_with_its_eval_metrics(example):
    name, run_dir = example
    (start,) = events(run_dir, "start")
    assert start["exact_elastic"], start["exact_elastic_why"]
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if any(k.startswith("eval_") for k in r)]
    assert [r["step"] for r in evals] == [6, 12]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))


def test_a_sigkilled_example_resumes_from_its_local_tier_bitwise(example, tmp_path):
    name, uninterrupted = example
    run_dir, local = tmp_path / "run", tmp_path / "local"
    args = train(name, run_dir, "--set", f"checkpoint.local.dir='{local}'")
    # Slow steps while it is killed (not part of the math): the kill lands before step 8's checkpoints.
    assert kill_at_step([*args, *SLOW_STEPS], run_dir, 7, signal.SIGKILL, env=ENV_EXAMPLES) == -signal.SIGKILL
    harness(*args, env=ENV_EXAMPLES, check=True)
    start = events(run_dir, "start")[-1]
    assert (start["resumed_from"], start["resumed_tier"]) == (6, "local"), start
    assert not events(run_dir, "resume_mismatch")
    assert_same_run(uninterrupted, run_dir, STEPS)


def test_an_example_loses_a_node_under_torchrun_and_goes_on_alone_bitwise(example, tmp_path):
    name, uninterrupted = example
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    config = EXAMPLES / f"{name}.toml"
    nodes = agents(run_dir, locals_, logs, *SHORT, *SLOW_STEPS, config=config, common=(), env=ENV_EXAMPLES)
    lose_all(nodes, run_dir, 7, logs[0], starts=1)
    shutil.rmtree(locals_[1])
    alone = harness(*train(name, run_dir, "--set", f"checkpoint.local.dir='{locals_[0]}'"), env=ENV_EXAMPLES)
    assert alone.returncode == 0, alone.stderr[-3000:] + tail(logs[0])
    start = events(run_dir, "start")[-1]
    assert (start["resumed_from"], start["resumed_tier"], start["world_size"], start["saved_world_size"]) \
        == (6, "local", 1, 2), start
    assert not events(run_dir, "resume_mismatch")
    assert_same_run(uninterrupted, run_dir, STEPS)


def test_verify_resume_certifies_a_task_unchanged(tmp_path):
    """`harness verify-resume` on the example with a whole step (two optimizers, two cadences):
    interrupted twice by SIGKILL, every step's fingerprints and the final checkpoints identical."""
    proc = harness("verify-resume", str(EXAMPLES / "two_cadences.toml"), "--steps", "12", "--interrupt-at", "6,10",
                   "--set", "checkpoint.every_steps=4", "--set", "checkpoint.async_save=false",
                   "--work-dir", str(tmp_path), env=ENV_EXAMPLES, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "identical: 12 steps" in proc.stdout and "resumed from 8" in proc.stdout, proc.stdout
