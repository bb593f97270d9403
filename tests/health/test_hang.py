"""Hangs end in a restart: a step that blocks forever, a data worker that never returns, and one
rank of a 2-rank gloo group that hangs. Real `harness train` processes; the watchdog dumps the
stacks into the log dir, exits 79 (HUNG), the supervisor (or torchrun) restarts the run, and it
finishes bitwise equal to a run that never hung. The floor is 10 s: quick enough, and far above
a tiny step on a busy machine; nothing here asserts on time."""

import sys
from pathlib import Path

from procs import TINY, assert_same_run, events, harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from launch import run as run_launcher, tail, torchrun, train_cli  # noqa: E402

# Limit max(2 x median step, 10 s): what a planted hang waits for. With 3 s, a step slowed by a
# loaded machine could pass for a hang: a second restart the assertions would count.
HANG = ["--set", "health.hang_floor_s=10", "--set", "health.hang_factor=2", "--set", "debug.hang_at_step=6"]


def hang_dumps(run_dir, rank: int = 0) -> list[str]:
    return [p.read_text() for p in sorted(run_dir.glob(f"hang-rank-{rank:05d}-pid-*.txt"))]


def assert_restarted_after_hang(run_dir, phase: str) -> None:
    kinds = [e for e in events(run_dir) if e["event"] in ("hang", "restart")]
    assert [e["event"] for e in kinds] == ["hang", "restart"], kinds
    hang, restart = kinds
    assert hang["phase"] == phase and hang["step"] >= 6 and hang["limit_s"] >= 3
    assert restart["exit_code"] == 79 and restart["cause"] == "exit code 79 (hung)"
    assert [e["reason"] for e in events(run_dir) if e["event"] == "exit"] == ["hung", "finished"]


def test_a_step_that_blocks_forever_is_dumped_and_restarted(tmp_path, continuous):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "2", "--backoff-initial", "0.1", *HANG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hang: no progress within the limit" in proc.stderr
    assert_restarted_after_hang(run, "step")
    (dump,) = hang_dumps(run)
    assert "hang_in_step" in dump and "train_step" not in dump  # the stuck frame, in the step's watch
    assert_same_run(continuous, run, 12)


def test_a_data_worker_that_never_returns_is_dumped_and_restarted(tmp_path, continuous):
    """The hang is in a DataLoader worker: the trainer waits on the loader's queue. (The data
    order does not depend on the worker count, so the run equals the one without workers.)"""
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "2", "--backoff-initial", "0.1",
                   "--set", "data.num_workers=2", *HANG, "--set", 'debug.hang_in="data"')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_restarted_after_hang(run, "step")
    (dump,) = hang_dumps(run)
    assert "_get_data" in dump or "_next_data" in dump  # the trainer waits for the loader
    assert (run / ".hung-at-6-rank-00000").exists()
    assert_same_run(continuous, run, 12)


def test_one_rank_of_a_gloo_group_hangs_and_torchrun_restarts_the_group(tmp_path):
    """Rank 1 hangs in step 6; rank 0 waits for it in that step's collectives. Both watchdogs
    fire (79), torchrun restarts the group once, and the run finishes."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun(*train_cli(run_dir, *HANG, "--set", "debug.hang_rank=1"), max_restarts=1)
    assert run_launcher(args, log) == 0, tail(log)
    assert "hang_in_step" in "".join(hang_dumps(run_dir, rank=1)), tail(log)
    hangs = [e for e in events(run_dir) if e["event"] == "hang"]
    assert hangs and hangs[0]["phase"] == "step" and hangs[0]["step"] == 6, hangs
    finished = [e for e in events(run_dir) if e["event"] == "exit" and e["reason"] == "finished"]
    assert finished and finished[0]["step"] == 12
