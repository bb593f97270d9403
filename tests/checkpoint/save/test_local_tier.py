"""The local checkpoint tier (harness/checkpoint/save/local_tier.py) with real processes: a crash resumes from
the newest local checkpoint and ends bitwise equal to an uninterrupted run; a damaged local copy,
or another run's, is skipped and reported, never loaded."""

import json
import shutil
from pathlib import Path

import pytest

from harness.run.cadence import CheckpointClock
from helpers import flip_byte
from procs import TINY, assert_one_line_error, assert_same_run, events, harness, kill_at_step, losses

STEPS = 12  # TINY's train.steps


def local_tier(folder: Path, every: int = 2) -> list[str]:
    return ["--set", f"checkpoint.local.dir='{folder}'", "--set", f"checkpoint.local.every_steps={every}"]


def train(run: Path, *args: str) -> list[str]:
    return ["train", str(TINY), "--run-dir", str(run), *args]


def local_steps(folder: Path) -> dict[int, Path]:
    """step -> checkpoint folder of the local tier's one run under `folder` (one process: rank 0)."""
    (run_folder,) = folder.iterdir()
    return {int(p.name.removeprefix("step-")): p for p in (run_folder / "rank-00000" / "checkpoints").glob("step-*")}


def starts(run: Path) -> list[dict]:
    return [e for e in events(run) if e["event"] == "start"]


@pytest.fixture(scope="module")
def continuous(tmp_path_factory) -> Path:
    """TINY uninterrupted, without a local tier (the tier must not change the math)."""
    run = tmp_path_factory.mktemp("continuous") / "run"
    harness(*train(run), check=True)
    return run


def test_sigkill_resumes_from_the_local_tier_bitwise(tmp_path, continuous):
    run, local = tmp_path / "run", tmp_path / "local"
    args = train(run, "--set", "checkpoint.every_steps=10", *local_tier(local))
    assert kill_at_step(args, run, 7) != 0
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step-*"))
    harness(*args, check=True)
    start = starts(run)[-1]
    # Local saves run in the background (checkpoint.async_save): the newest taken may have been in
    # flight at the kill, every one before it was committed (the next save waits for it).
    newest_taken = start["previous_reached"] - start["previous_reached"] % 2
    newest_local = start["resumed_from"]
    assert start["resumed_tier"] == "local" and newest_local in (newest_taken, newest_taken - 2) and newest_local >= 4
    assert_same_run(run, continuous, STEPS)
    lost = start["previous_reached"] - newest_local
    said = f"step {newest_local} from the local tier, {lost} step{'s' if lost != 1 else ''} lost"
    report = harness("report", str(run), check=True).stdout
    assert said in report
    # No persistent checkpoint before the crash: without the local tier every step would re-run.
    assert "without the local tier: goodput" in report and f"({newest_local} more step(s) re-run" in report
    assert said in harness("status", str(run), check=True).stdout


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_a_damaged_local_copy_is_skipped_and_reported(tmp_path, continuous, damage):
    """Local every 2 steps (not where the persistent tier saves: 4, 8), crash after step 7: local 2
    and 6, persistent 4. Local 6 damaged -> rejected, resumed from persistent 4."""
    run, local = tmp_path / "run", tmp_path / "local"
    args = train(run, "--set", "checkpoint.async_save=false", *local_tier(local))
    assert harness(*args, "--set", "debug.crash_at_step=7").returncode != 0
    step6 = local_steps(local)[6]
    model = step6 / "model.safetensors"
    if damage == "flip":
        flip_byte(model, at=-9, mask=0x10)
    else:
        model.unlink()
    harness(*args, check=True)
    (rejected,) = [e for e in events(run) if e["event"] == "checkpoint_rejected"]
    assert rejected["tier"] == "local" and rejected["step"] == 6 and "model.safetensors" in rejected["problem"]
    start = starts(run)[-1]
    assert (start["resumed_from"], start["resumed_tier"]) == (4, "persistent")
    assert_same_run(run, continuous, STEPS)


def test_another_runs_local_checkpoint_is_not_used(tmp_path, continuous):
    """Run `other` (another seed) and this run share the local folder. A copy of other's step 6
    placed among this run's local checkpoints is rejected (its meta names another run id); this
    run resumes from its own local step 2 (saved in the step loop: committed before the crash)."""
    local = tmp_path / "local"
    other, run = tmp_path / "other", tmp_path / "run"
    common = ["--set", "checkpoint.every_steps=10", "--set", "checkpoint.async_save=false", *local_tier(local)]
    assert harness(*train(other, *common, "--set", "train.seed=2", "--set", "debug.crash_at_step=7")).returncode != 0
    (other_folder,) = local.iterdir()
    assert harness(*train(run, *common, "--set", "debug.crash_at_step=3")).returncode != 0
    (mine,) = [p for p in local.iterdir() if p != other_folder]
    copied = "rank-00000/checkpoints/step-00000006"
    shutil.copytree(other_folder / copied, mine / copied)
    harness(*train(run, *common), check=True)
    (rejected,) = [e for e in events(run) if e["event"] == "checkpoint_rejected"]
    assert rejected["step"] == 6 and other_folder.name in rejected["problem"]
    start = starts(run)[-1]
    assert (start["resumed_from"], start["resumed_tier"]) == (2, "local")
    assert_same_run(run, continuous, STEPS)


def test_a_copy_past_a_later_resume_with_a_config_change_is_rejected(tmp_path):
    """A node absent while the run resumed from persistent step 4 with a changed learning rate
    comes back holding its local step 6 of the old timeline (newer than 4, written with the old
    rate): rejected as an abandoned future, so the run resumes from 4 again and keeps the change
    (its step 5 is the one the changed run logged), rather than undoing it."""
    run, local, away = tmp_path / "run", tmp_path / "local", tmp_path / "away"
    args = train(run, "--set", "checkpoint.async_save=false", *local_tier(local))
    assert harness(*args, "--set", "debug.crash_at_step=7").returncode != 0  # local 2, 6; persistent 4
    assert 6 in local_steps(local)
    local.rename(away)  # the node is gone for a while, with its disk
    changed = [*args, "--allow-config-change", "--set", "optim.lr=1e-3"]
    assert harness(*changed, "--set", "debug.crash_at_step=5").returncode != 0
    assert (starts(run)[-1]["resumed_from"], starts(run)[-1]["resumed_tier"]) == (4, "persistent")
    changed_step_5 = losses(run)[5]
    shutil.rmtree(local, ignore_errors=True)  # nothing saved there by a run that stopped before step 6
    away.rename(local)  # the node is back: its step 6 is newer than anything the run holds
    harness(*changed, check=True)
    (rejected,) = [e for e in events(run) if e["event"] == "checkpoint_rejected"]
    assert rejected["tier"] == "local" and rejected["step"] == 6
    assert "abandoned future: start 1 of the run resumed from step 4" in rejected["problem"], rejected
    assert (starts(run)[-1]["resumed_from"], starts(run)[-1]["resumed_tier"]) == (4, "persistent")
    assert losses(run)[5] == changed_step_5
    assert json.loads((run / "run.json").read_text())["starts"] == [0, 4, 4]


def test_supervisor_restart_resumes_from_the_local_tier(tmp_path, continuous):
    run, local = tmp_path / "run", tmp_path / "local"
    harness(*train(run, "--max-restarts", "1", "--backoff-initial", "0.1", "--set", "checkpoint.every_steps=10",
                   *local_tier(local), "--set", "debug.crash_at_step=7"), check=True)
    first, second = starts(run)
    assert first["resumed_from"] is None
    # Local 6 was saved in the background and may have been in flight at the crash; 4 was committed.
    assert (second["resumed_from"], second["resumed_tier"]) in ((6, "local"), (4, "local"))
    assert_same_run(run, continuous, STEPS)


def test_a_bad_local_tier_setting_is_a_one_line_error(tmp_path):
    proc = harness(*train(tmp_path / "run", *local_tier(tmp_path / "local", every=0)))
    assert_one_line_error(proc, "checkpoint.local.every_steps")


def test_a_rollback_then_a_kill_resumes_from_the_local_tier_bitwise(tmp_path):
    """A NaN at step 7 rolls back to persistent 4 (local 6 is dropped: the state went back); a
    SIGKILL after step 11 resumes from a local checkpoint taken after the rollback: 10, or 8 when
    10 was still in flight in the background at the kill."""
    rollback = ["--set", 'train.on_anomaly="rollback"', "--set", "debug.nan_at_steps=[7]"]
    cont, run, local = tmp_path / "continuous", tmp_path / "run", tmp_path / "local"
    harness(*train(cont, *rollback), check=True)
    args = train(run, *rollback, *local_tier(local))
    assert kill_at_step(args, run, 11) != 0
    harness(*args, check=True)
    start = starts(run)[-1]
    assert start["resumed_tier"] == "local" and start["resumed_from"] in (8, 10)
    assert_same_run(cont, run, STEPS)


def test_a_resume_or_a_rollback_deletes_the_local_checkpoints_past_its_step(tmp_path):
    """Local checkpoints past the step the live state went back to belong to an abandoned future:
    a LocalTier made at a resume from step 4 deletes 6 and 8, and a rollback to 2 deletes 4."""
    import torch

    from harness.checkpoint.save.local_tier import LocalTier
    from harness.config import LocalTierSection

    section = LocalTierSection(dir=str(tmp_path), every_steps=2, keep=10)
    tier = LocalTier(section, "run-a", resumed_step=0)
    for step in (2, 4, 6, 8):
        tier.save(step, {"model": torch.nn.Linear(2, 2)}, {})

    def steps() -> list[int]:
        return [ref.step for ref in tier.store.list()]

    assert steps() == [2, 4, 6, 8]
    LocalTier(section, "run-a", resumed_step=4)
    assert steps() == [2, 4]
    tier.drop_after(2)
    assert steps() == [2]



def test_auto_is_accepted_for_the_local_tier_and_other_words_are_not():
    from harness.config import load_config
    from harness.errors import UserError

    folder = "checkpoint.local.dir='/tmp/local-tier'"
    assert load_config(TINY, [folder, 'checkpoint.local.every_steps="auto"']).checkpoint.local.every_steps == "auto"
    assert load_config(TINY, [folder, "checkpoint.local.every_steps=3"]).checkpoint.local.every_steps == 3
    for wrong in ('"autox"', "0"):
        with pytest.raises(UserError, match="every_steps"):
            load_config(TINY, [folder, f"checkpoint.local.every_steps={wrong}"])


def test_local_auto_measures_one_local_save_then_saves_at_the_interval_it_chose(tmp_path):
    """`checkpoint.local.every_steps = "auto"` beside a fixed persistent interval (10): a local save
    after step 1 measures the tier, the interval is chosen after 3 more timed steps (a
    `checkpoint_interval` event with tier = "local") and the local saves follow it, at the steps
    where no persistent save is due. A tiny MTBF makes the interval a few steps at most, so 12
    steps show it."""
    run, local = tmp_path / "run", tmp_path / "local"
    harness(*train(run, "--set", "checkpoint.every_steps=10", "--set", "checkpoint.mtbf_hours=0.0001",
                   "--set", f"checkpoint.local.dir='{local}'", "--set", 'checkpoint.local.every_steps="auto"'),
            check=True)
    (choice,) = events(run, "checkpoint_interval")
    assert choice["tier"] == "local" and choice["mtbf_s"] == pytest.approx(0.36)
    every = choice["every_steps"]
    expected, last = [1], 1
    for step in range(1 + CheckpointClock.AUTO_WARMUP_STEPS, STEPS):  # chosen after step 4, before its save
        if step % 10 and step - last >= every:
            expected.append(step)
            last = step
    assert [e["step"] for e in events(run, "local_checkpoint")] == expected
    assert [e["step"] for e in events(run, "checkpoint")] == [10, 12]
    # In the background, as the run dir's saves (checkpoint.async_save), each one committed.
    assert all(e["background"] for e in events(run, "local_checkpoint"))
    assert sorted(e["step"] for e in events(run, "local_committed")) == expected
