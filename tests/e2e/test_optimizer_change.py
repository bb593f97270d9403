"""A task's own optimizers and torch schedulers resumed with a changed setting, in real processes
(tests/task/own_optimizers.py: Muon + AdamW, a torch LambdaLR, StepLR or CosineAnnealingLR each):
the value built from the config or the task's code is in force from the first resumed step, or
the resume is refused naming both values; never silently the checkpoint's."""

import json
import shutil

import pytest

from procs import ENV, ROOT, assert_one_line_error, events, harness, losses

CONFIG = ROOT / "tests" / "task" / "own_optimizers.toml"


def lrs(log_dir, name: str) -> dict[int, list[float]]:
    """step -> the lrs of optimizer `name` that step trained with (metrics.jsonl)."""
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"][name] for r in lines if "lr" in r}


def train(run, *sets: str, env: dict | None = None, allow: bool = False):
    args = [a for s in sets for a in ("--set", s)] + (["--allow-config-change"] if allow else [])
    return harness("train", str(CONFIG), "--run-dir", str(run), *args, env=env)


def crashed_after_step_4(run, *sets: str):
    """A run that checkpointed step 4 and crashed at step 6."""
    crashed = train(run, *sets, "debug.crash_at_step=6")
    assert crashed.returncode == 13, crashed.stderr[-2000:]
    return run


def test_a_changed_lr_with_a_lambdalr_applies_from_the_first_resumed_step(tmp_path):
    base = crashed_after_step_4(tmp_path / "base")
    same, lower = tmp_path / "same", tmp_path / "lower"
    for copy in (same, lower):
        shutil.copytree(base, copy)
    assert train(same).returncode == 0
    resumed = train(lower, "task.args.lr_muon=0.005", allow=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    # Step 5 starts from the same parameters (same loss) and updates them with the new lr.
    a, b = losses(same), losses(lower)
    assert [a[s] for s in range(1, 6)] == [b[s] for s in range(1, 6)]
    assert all(a[s] != b[s] for s in range(6, 9))
    muon_a, muon_b = lrs(same, "muon"), lrs(lower, "muon")
    assert all(muon_b[s] == pytest.approx([x / 4 for x in muon_a[s]], rel=1e-12) for s in range(5, 9))
    assert lrs(same, "adamw") == lrs(lower, "adamw")
    (change,) = events(lower, "config_changed")
    assert change["changes"] == {"task.args.lr_muon": {"old": 0.02, "new": 0.005}}
    assert change["optimizers"] == {"optim muon/initial_lr": {"old": 0.02, "new": 0.005},
                                    "sched muon/base_lrs": {"old": [0.02], "new": [0.005]}}


@pytest.mark.parametrize("scheduler, key, old, new, attribute", [("step", "step_size", 3, 2, "step_size"),
                                                                 ("cosine", "t_max", 8, 16, "T_max")])
def test_a_changed_torch_scheduler_setting_lands_at_the_first_resumed_step(tmp_path, scheduler, key, old, new,
                                                                           attribute):
    """The resumed run trains steps 5-8 with the lrs a run with the new setting from the start has."""
    kind = f"task.args.scheduler='{scheduler}'"
    run = crashed_after_step_4(tmp_path / "run", kind)
    resumed = train(run, kind, f"task.args.{key}={new}", allow=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    fresh = tmp_path / "fresh"
    assert train(fresh, kind, f"task.args.{key}={new}").returncode == 0
    unchanged = tmp_path / "unchanged"
    assert train(unchanged, kind).returncode == 0
    for name in ("muon", "adamw"):
        got, want, before = lrs(run, name), lrs(fresh, name), lrs(unchanged, name)
        assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)], name
        assert [got[s] for s in range(5, 9)] != [before[s] for s in range(5, 9)], name
    (change,) = events(run, "config_changed")
    assert change["optimizers"] == {f"sched {n}/{attribute}": {"old": old, "new": new} for n in ("adamw", "muon")}


def test_a_changed_lr_without_allow_config_change_is_refused_naming_old_and_new(tmp_path):
    run = crashed_after_step_4(tmp_path / "run")
    refused = train(run, "task.args.lr_muon=0.005")
    assert_one_line_error(refused, "task.args.lr_muon 0.02 -> 0.005")


def test_a_schedule_the_task_code_changed_is_refused_then_in_force_when_allowed(tmp_path):
    """Only the LambdaLR's code changed (its warm-up, 4 -> 8 steps), not the config: the lrs its
    lambdas give at the restored step differ from the saved ones, which a function cannot save."""
    run = crashed_after_step_4(tmp_path / "run")
    longer = {**ENV, "OWN_OPTIMIZERS_WARMUP": "8"}
    assert_one_line_error(train(run, env=longer), "sched adamw/lr at step 4 (lr_lambdas) [0.01] -> [0.00625]")
    assert train(run, env=longer, allow=True).returncode == 0
    assert [lrs(run, "muon")[s] for s in range(5, 9)] == [[pytest.approx(0.02 * s / 8, rel=1e-12)] for s in range(5, 9)]
    (change,) = events(run, "config_changed")
    assert change["changes"] == {}
    assert change["optimizers"]["sched muon/lr at step 4 (lr_lambdas)"] == {"old": [0.02], "new": [0.0125]}


def test_a_task_returning_our_multiopt_and_multisched_resumes_bitwise(tmp_path):
    ours = "task.args.bundle='ours'"
    run = crashed_after_step_4(tmp_path / "run", ours)
    assert train(run, ours).returncode == 0
    whole = tmp_path / "whole"
    assert train(whole, ours).returncode == 0
    assert losses(run) == losses(whole)
    assert not events(run, "config_changed") and not events(run, "resume_mismatch")
