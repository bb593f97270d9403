"""ops/torchrun/train.sh and ops/slurm/train.sbatch run for real: real torchrun, real trainers,
with stub `srun` (runs its task, passes signals on, as srun does), `scontrol` (hostnames; records
requeues) and `sbatch` (records the submission) on PATH.

What must hold: a stop signal to the launcher's shell reaches every trainer, which save and exit
75, and the launcher exits 75 although torchrun itself reports a failure; the SLURM script
requeues 75 and the storage-unavailable code (after retrying that one in the job with a backoff),
and nothing else: not a user error, not a crash that happened after a stop was requested.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from harness import exit_codes
from harness.checkpoint import CheckpointStore
from launch import COMMON, TORCHRUN_ENV, kill_tree, rank_process, tail, wait_step
from procs import ROOT, TINY, assert_same_run, events, final_checkpoint, spawn

TRAIN_SH = ROOT / "ops/torchrun/train.sh"
SBATCH = ROOT / "ops/slurm/train.sbatch"
ELASTIC = ROOT / "tests/data/elastic.toml"  # train.global_batch 8 at world size 1, 2 or 4
SLOW_STEPS = ["--set", "debug.step_sleep_s=0.3"]  # a window to signal in; not part of the math

STUBS = {
    "srun": """#!/usr/bin/env bash
# srun: run the task given after the options; pass TERM/USR1/INT on to it, as srun does.
while [ "${1#--}" != "$1" ]; do shift; done
echo "$*" >> "$STUB_LOG/srun"
"$@" &
task=$!
for s in TERM USR1 INT; do trap "kill -s $s $task" $s; done
wait $task; rc=$?
while kill -0 $task 2>/dev/null; do wait $task; rc=$?; done
exit $rc
""",
    "scontrol": """#!/usr/bin/env bash
case "$1" in
  show) echo node-a; echo node-b ;;
  requeue) echo "$2" >> "$STUB_LOG/requeued" ;;
esac
""",
    "sbatch": """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG/sbatch"
""",
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "stub-log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in STUBS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}{TORCHRUN_ENV['PATH']}", "STUB_LOG": str(log)}, log


def launch(cmd: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen:
    with log.open("ab") as out:
        return spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env={**TORCHRUN_ENV, **env}, cwd=cwd)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            print(tail(log))


def preempted_step(run_dir: Path) -> int:
    [stop] = events(run_dir, "exit")
    assert stop["reason"] == "preempted"
    return stop["step"]


# --- ops/torchrun/train.sh ----------------------------------------------------------------------

def test_train_sh_passes_term_to_every_trainer_exits_75_and_resumes_bitwise(tmp_path, continuous):
    """TERM here; USR1 takes the same path from the SLURM script (test_sbatch_preempted_...)."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    env = {"NPROC": "2", "MAX_RESTARTS": "1", "RUN_DIR": str(run_dir)}
    proc = launch([str(TRAIN_SH), str(TINY), *COMMON, *SLOW_STEPS], log, env)
    wait_step(proc, run_dir, 5, log)
    proc.send_signal(signal.SIGTERM)  # to the shell only: torchrun and the trainers hear it from the script
    assert finish(proc, log) == exit_codes.PREEMPTED, tail(log)
    step = preempted_step(run_dir)
    assert CheckpointStore(str(run_dir)).latest_good().step == step >= 5
    assert (final_checkpoint(run_dir, step) / "rank-00001.json").exists()  # rank 1 saved its part too
    assert finish(launch([str(TRAIN_SH), str(TINY), *COMMON], log, env), log) == 0, tail(log)
    assert_same_run(continuous, run_dir, 12)


def test_train_sh_prints_a_refused_config_once_and_exits_2(tmp_path):
    """torchrun restarts every failed worker group; a restart after exit 2 exits 2 at once
    (exit_codes.earlier_stop) instead of refusing the config again."""
    log = tmp_path / "train.log"
    env = {"NPROC": "1", "MAX_RESTARTS": "3", "RUN_DIR": str(tmp_path / "run")}
    code = finish(launch([str(TRAIN_SH), str(TINY), "--set", "train.stepz=3"], log, env), log)
    assert code == exit_codes.USER_ERROR, tail(log)
    errors = [line for line in log.read_text().splitlines() if "train.stepz: unknown key" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), tail(log)


def test_train_sh_does_not_restart_a_run_stopped_on_an_anomaly(tmp_path):
    """A model whose gradients turn NaN at its 13th forward in a process (step 7; after a restart
    step 11 from checkpoint 4, then never from checkpoint 8): with train.on_anomaly = "stop" the
    run stops at step 7 with exit 2 and is not restarted past the anomaly."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    # torchrun starts the `harness` script, whose sys.path lacks the working folder: `tests` imports
    # from the repository root on PYTHONPATH.
    env = {"NPROC": "2", "MAX_RESTARTS": "2", "RUN_DIR": str(run_dir), "PYTHONPATH": str(ROOT)}
    nan = ["--set", 'model.factory="tests.user_models:nan_grad_gpt"', "--set", "model.args.nan_grad_at_forward=13",
           "--set", 'train.on_anomaly="stop"']
    code = finish(launch([str(TRAIN_SH), str(TINY), *nan], log, env), log)
    assert code == exit_codes.USER_ERROR, tail(log)
    assert [e["resumed_from"] for e in events(run_dir, "start")] == [None], tail(log)
    [stop] = events(run_dir, "exit")
    assert stop["reason"] == "user_error" and "gradient norm is nan" in stop["error"] and stop["step"] == 6


def test_train_sh_exits_3_once_a_supervisor_gave_up(tmp_path):
    """At NPROC=1, `harness train --max-restarts` runs its supervisor under torchrun: a crash at
    the same step each time is a crash loop (exit 3), which torchrun's restart does not repeat."""
    log = tmp_path / "train.log"
    env = {"NPROC": "1", "MAX_RESTARTS": "1", "RUN_DIR": str(tmp_path / "run")}
    loop = ["--max-restarts", "3", "--crash-loop-limit", "1", "--set", "debug.crash_at_step=6",
            "--set", "debug.crash_once=false"]
    assert finish(launch([str(TRAIN_SH), str(TINY), *loop], log, env), log) == exit_codes.GAVE_UP, tail(log)
    assert log.read_text().count("error: gave up") == 1, tail(log)


@pytest.mark.parametrize("fault", ["crash", "preempted-rank"])
def test_train_sh_still_restarts_a_crash_or_a_preempted_rank(tmp_path, continuous, fault):
    """The codes to retry are retried by torchrun's restarts: a crash of every rank after step 6
    (exit 13), or a stop signal that reached one rank only (the group saves and exits 75). The
    crash is taken with a local tier on (local saves at 1-3 and 5): the restarted group on the
    same node resumes from its local step 5, not the persistent step 4."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    env = {"NPROC": "2", "MAX_RESTARTS": "1", "RUN_DIR": str(run_dir)}
    local_tier = ["--set", f"checkpoint.local.dir='{tmp_path / 'local'}'", "--set", "checkpoint.local.every_steps=1"]
    extra = ["--set", "debug.crash_at_step=6", *local_tier] if fault == "crash" else SLOW_STEPS
    proc = launch([str(TRAIN_SH), str(TINY), *COMMON, *extra], log, env)
    if fault == "preempted-rank":
        wait_step(proc, run_dir, 5, log)
        rank_process(proc, 1).send_signal(signal.SIGTERM)
    assert finish(proc, log) == exit_codes.FINISHED, tail(log)
    starts = events(run_dir, "start")
    resumed = [e["resumed_from"] for e in starts]
    assert resumed[0] is None and len(resumed) == 2 and resumed[1] >= 4, resumed
    if fault == "crash":
        assert (resumed[1], starts[1]["resumed_tier"]) == (5, "local"), starts[1]
    assert_same_run(continuous, run_dir, 12)


# --- ops/slurm/train.sbatch ---------------------------------------------------------------------

def slurm_env(job_id: int, run_dir: Path, config: Path = TINY, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_JOB_NUM_NODES": "1", "GPUS_PER_NODE": "1", "MAX_RESTARTS": "0", "CONFIG": str(config),
            "RUN_DIR": str(run_dir), **extra}


def requeued(stub_log: Path) -> list[str]:
    path = stub_log / "requeued"
    return path.read_text().split() if path.exists() else []


def test_sbatch_preempted_run_exits_75_is_requeued_and_resumes_at_another_size(tmp_path, stubs):
    """The requeued job gets another allocation (2 GPUs instead of 1: the world size changes as
    it would with another node count) and resumes there with the global batch kept."""
    env, stub_log = stubs
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    config = tmp_path / "slow.toml"
    config.write_text(f'extends = "{ELASTIC}"\n[debug]\nstep_sleep_s = 0.3\n')
    proc = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(4242, run_dir, config)})
    wait_step(proc, run_dir, 3, log)
    proc.send_signal(signal.SIGUSR1)
    assert finish(proc, log) == exit_codes.PREEMPTED, tail(log)
    assert requeued(stub_log) == ["4242"]
    assert CheckpointStore(str(run_dir)).latest_good().step == preempted_step(run_dir)
    assert f"RDZV_ENDPOINT=node-a:{20000 + 4242 % 12000}" in (stub_log / "srun").read_text()
    requeue = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(4242, run_dir, config, GPUS_PER_NODE="2")})
    assert finish(requeue, log) == exit_codes.FINISHED, tail(log)
    [change] = events(run_dir, "world_size_changed")
    assert (change["old_world_size"], change["new_world_size"]) == (1, 2)
    assert (change["old"]["grad_accum"], change["new"]["grad_accum"], change["new"]["global_batch"]) == (4, 2, 8)


def test_sbatch_does_not_requeue_a_user_error(tmp_path, stubs):
    env, stub_log = stubs
    log = tmp_path / "job.log"
    proc = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(7, tmp_path / "run", tmp_path / "missing.toml")})
    assert finish(proc, log) == exit_codes.USER_ERROR, tail(log)
    assert "config file" in tail(log) and requeued(stub_log) == []
    assert f"RDZV_ENDPOINT=node-a:{20000 + 7}" in (stub_log / "srun").read_text()


def test_sbatch_does_not_requeue_a_crash_after_a_stop_request(tmp_path, stubs):
    env, stub_log = stubs
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    config = tmp_path / "deaf.toml"  # USR1 is not a stop signal here: the trainer dies of it, a crash
    config.write_text(f'extends = "{TINY}"\n[checkpoint]\npreempt_signals = ["SIGTERM"]\n[debug]\nstep_sleep_s = 0.3\n')
    proc = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(8, run_dir, config)})
    wait_step(proc, run_dir, 2, log)
    proc.send_signal(signal.SIGUSR1)
    code = finish(proc, log)
    assert code not in exit_codes.REQUEUE | exit_codes.RETRY_LATER | {0}, tail(log)
    assert requeued(stub_log) == [] and "not requeued" in tail(log)


def test_storage_unavailable_is_retried_with_backoff_by_train_sh_then_requeued(tmp_path, stubs):
    env, stub_log = stubs
    log = tmp_path / "job.log"
    config = tmp_path / "s3.toml"
    config.write_text(f'extends = "{TINY}"\n[checkpoint.storage_options]\nendpoint_url = "http://127.0.0.1:9"\n'
                      f'retry = {{ attempts = 3, initial = 0.05, max_wait = 0.1, deadline_s = 1 }}\n')
    extra = {"UNAVAILABLE_RETRIES": "1", "UNAVAILABLE_BACKOFF_S": "1", "AWS_ACCESS_KEY_ID": "k",
             "AWS_SECRET_ACCESS_KEY": "s", "AWS_EC2_METADATA_DISABLED": "true"}
    proc = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(9, "s3://bucket/run", config, **extra)})
    assert finish(proc, log) == exit_codes.STORAGE_UNAVAILABLE, tail(log)
    text = log.read_text()
    assert "storage endpoint http://127.0.0.1:9 unavailable" in text
    assert "retry 1 of 1 in 1s" in text
    assert text.count("storage endpoint http://127.0.0.1:9 unavailable") >= 2  # tried again after the backoff
    assert requeued(stub_log) == ["9"]


def test_sbatch_run_directly_creates_the_log_folder_and_submits_itself(tmp_path, stubs):
    env, stub_log = stubs
    proc = subprocess.run(["bash", str(SBATCH), "--nodes=2"], env={**TORCHRUN_ENV, **env}, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "logs").is_dir()
    assert (stub_log / "sbatch").read_text().split() == ["--nodes=2", str(SBATCH)]


def test_sbatch_requeues_a_hung_run(tmp_path, stubs):
    """A trainer hangs at step 6 (torchrun has no restarts left here): its watchdog exits 79,
    train.sh passes 79 on through torchrun's exit 1, and the job is requeued (below
    HANG_REQUEUES)."""
    env, stub_log = stubs
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    config = tmp_path / "hang.toml"
    config.write_text(f'extends = "{TINY}"\n[health]\nhang_floor_s = 10\n[debug]\nhang_at_step = 6\n')
    proc = launch(["bash", str(SBATCH)], log, {**env, **slurm_env(11, run_dir, config)})
    assert finish(proc, log) == exit_codes.HUNG, tail(log)
    assert requeued(stub_log) == ["11"] and "a trainer hung (exit 79" in tail(log)
    assert list(run_dir.glob("hang-rank-00000-pid-*.txt"))
