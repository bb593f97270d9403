"""`harness train` under torchrun, world size 2, gloo, real processes killed for real.

Every interrupted run is compared with one continuous run of the same command: final
checkpoints bitwise equal (`harness ckpt diff`) and the same loss at every step. Muon runs in all
of them (launch.COMMON), so its orthogonalisation sees the all-reduced gradient throughout.
"""

import contextlib
import json
import os
import re
import signal

import psutil

from harness.checkpoint import CheckpointStore
from harness.checkpoint.manifest import MANIFEST_FILE
from harness.data import TokenDataset
from launch import kill_tree, rank_process, run, start, tail, torchrun, train_cli, wait_step
from procs import TINY, assert_same_run, events, final_checkpoint, harness, relayed

STEPS = 12


def test_checkpoint_has_every_rank_and_one_manifest(continuous):
    ckpt = final_checkpoint(continuous, STEPS)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    names = {f["name"] for f in manifest["files"]}
    assert {"model.safetensors", "optim.safetensors", "state.json", "rank-00000.safetensors",
            "rank-00001.safetensors", "rank-00001.json"} <= names
    state = json.loads((ckpt / "state.json").read_text())
    assert state["meta"]["world_size"] == 2
    # The ranks' RNG streams differ (dropout per rank) and the data cursor is the same global one.
    rank1 = json.loads((ckpt / "rank-00001.json").read_text())
    assert rank1["parts"]["data"] == state["parts"]["data"]
    assert rank1["parts"]["rng"]["python"] != state["parts"]["rng"]["python"]


def test_only_rank_0_prints_the_step_lines(continuous):
    """Every rank trains the same steps: the console shows each step line once (harness/log.py)."""
    text = (continuous.parent / "continuous.log").read_text()
    assert re.findall(r"\] step +.*\bstep=(\d+)", text) == ["4", "8", "12"], text[-3000:]
    assert len(re.findall(r"\] finished ", text)) == 1, text[-3000:]


def test_sigkill_one_rank_torchrun_restarts_the_group(tmp_path, continuous):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    proc = start(torchrun(*train_cli(run_dir), max_restarts=1), log)
    wait_step(proc, run_dir, 6, log, committed=4)
    rank_process(proc, 1).kill()
    assert proc.wait(300) == 0, tail(log)
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert [e["resumed_from"] for e in starts] == [None, 4], starts
    assert_same_run(continuous, run_dir, STEPS)


def test_lost_node_then_the_same_command_again(tmp_path, continuous):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun(*train_cli(run_dir))
    proc = start(args, log)
    wait_step(proc, run_dir, 7, log)
    kill_tree(proc.pid)  # torchrun and both workers at once (they run in their own sessions)
    proc.wait(60)
    assert run(args, log) == 0, tail(log)
    assert [e["resumed_from"] for e in events(run_dir) if e["event"] == "start"][-1] in (4, 8)
    assert_same_run(continuous, run_dir, STEPS)


def test_sigkill_of_the_agent_alone_ends_its_ranks_and_the_same_command_resumes(tmp_path, continuous):
    """torchrun starts its workers in sessions of their own, so a SIGKILL of torchrun's process
    group reaches the agent alone: the ranks must die with it (harness/process/parent_death.py) instead of
    training on without it, and the same command started again at once takes the run dir's lease
    over from them and finishes as the continuous run did. Where the workers torchrun started are
    relays (harness/forkserver/relay.py), the processes they stand for must die too."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun(*train_cli(run_dir))
    agent = start(args, log, new_session=True)
    ranks = [rank_process(agent, rank) for rank in (0, 1)]
    wait_step(agent, run_dir, 6, log, committed=4)
    ranks += [worker for worker in map(relayed, ranks) if worker not in ranks]
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(60)
    relaunch = start(args, log)  # at once, as a person or a scheduler would
    try:
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not [p for p in alive if _running(p)], "ranks outlived their agent"
        assert relaunch.wait(300) == 0, tail(log)
    finally:  # nothing left running after a failed assertion
        if relaunch.poll() is None:
            kill_tree(relaunch.pid)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()  # psutil checks that the pid is still this process
    run_events = events(run_dir)
    assert [e["resumed_from"] for e in run_events if e["event"] == "start"] in ([None, 4], [None, 8]), run_events
    assert [e["reason"] for e in run_events if e["event"] == "exit"] == ["finished"], "the old ranks trained on"
    assert_same_run(continuous, run_dir, STEPS)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_to_one_rank_every_rank_saves_the_same_step(tmp_path, continuous):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun(*train_cli(run_dir))
    proc = start(args, log)
    wait_step(proc, run_dir, 5, log)
    rank_process(proc, 1).send_signal(signal.SIGTERM)
    assert proc.wait(120) != 0  # torchrun reports the preempted group as failed
    [stop] = [e for e in events(run_dir) if e["event"] == "exit"]
    assert stop["reason"] == "preempted"
    preempted = CheckpointStore(str(run_dir)).latest_good()
    assert preempted.step == stop["step"] >= 5
    assert (final_checkpoint(run_dir, preempted.step) / "rank-00001.json").exists()
    assert run(args, log) == 0, tail(log)
    assert_same_run(continuous, run_dir, STEPS)


def test_rank_failing_mid_save_commits_nothing(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun(*train_cli(run_dir, "--set", "debug.fail_save_rank=1", "--set", "debug.fail_save_step=8"))
    assert run(args, log) != 0
    assert "rank 1 fails while writing its part of step 8" in tail(log)
    store = CheckpointStore(str(run_dir))
    assert store.latest_good().step == 4
    assert [r.step for r in store.list()] == [4]
    assert store.incomplete() == [], "the staged folder of the failed save was left behind"


def test_world_size_2_to_1_sees_every_sample_once(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 17 + b"\n" * 19)  # 1634 bytes: 102 windows, 96 for training
    train_set, _ = TokenDataset.from_url(str(text), 16).split(0.05)
    assert train_set.num_samples == 96
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    extra = ["--set", f"data.url='{text}'", "--set", "debug.sample_log=true", "--set", "optim.type=muon"]
    assert run(torchrun(*train_cli(run_dir, *extra[:4], "--set", "debug.crash_at_step=6")), log) != 0
    single = harness("train", str(TINY), "--run-dir", str(run_dir), *extra)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "bitwise equality with an uninterrupted run is not promised across world sizes" in single.stderr
    resumed_from = [e for e in events(run_dir) if e["event"] == "start"][-1]["resumed_from"]
    assert resumed_from == 4
    seen = []
    for rank in (0, 1):
        for line in (run_dir / f"samples-rank-{rank:05d}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["world"] == 1 or rec["step"] <= resumed_from:
                seen.append(rec)
    assert {r["world"] for r in seen if r["step"] > resumed_from} == {1}
    epoch0 = sorted(i for r in seen if r["epoch"] == 0 for i in r["ids"])
    epoch1 = [i for r in seen if r["epoch"] == 1 for i in r["ids"]]
    assert epoch0 == list(range(96)), "epoch 0: a sample repeated or skipped across the world-size change"
    assert len(epoch1) == len(set(epoch1)) == (STEPS - 8) * 8
