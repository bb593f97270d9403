"""Spot continuation: nodes lost with their disks, no replacement for a while, and every bit kept
(checkpoint/save/coverage.py, checkpoint/save/local_recovery.py, docs/checkpoint-tiers.md).

Each node is a torchrun agent with a local folder of its own (tests/distributed/nodes.py); the
persistent tier is saved every 4 steps, the local tier every 2 (where no persistent save is
due) with peer copies; exact elastic mode is on by default (tests/data/spot.toml sets no
`exact_elastic`). A loss kills every process of the run with SIGKILL and deletes the lost
node's folder. Each restart must resume from the local tier, at most one local interval lost
(2 steps), and the run must end bit for bit where an uninterrupted world-size-2 run ends
(every loss, the final model, optimizer, schedulers, counters, fingerprints): from copies
written at another world size (2 -> 1, 1 -> 2, 4 -> 2, under DDP and FSDP), from a copy another
node sent, and after a second loss right after the first (re-replication). Without the coverage
rule, every restart below falls back to the persistent tier."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compare import bitwise_differences, losses_of
from launch import COMMON, HARNESS, Ranks, agent_of_rank, free_port, kill_all, kill_tree, run, start, tail, wait_step
from nodes import CADENCE, agents, steps_in
from procs import ROOT, events, harness, spawn

SPOT = ROOT / "tests" / "data" / "spot.toml"
STEPS = 16


FSDP = ["--set", "parallel.strategy='fsdp'"]
NO_PEERS = ["--set", "checkpoint.local.peer_jump=0"]
# Steps slowed (not part of the math) while a test waits for peer copies after step 7: persistent 8
# must not be committed before the kill on a loaded machine.
SLOW = ["--set", "debug.step_sleep_s=0.3"]


def reference(tmp_path_factory, name: str, *extra: str) -> Path:
    """World size 2, never interrupted (the local tier does not change the math)."""
    run_dir = tmp_path_factory.mktemp(name)
    log = run_dir.parent / f"{name}.log"
    args = ("train", str(SPOT), "--run-dir", str(run_dir), *COMMON, *CADENCE, *extra, "--set",
            f"checkpoint.local.dir='{run_dir.parent / f'{name}-local'}'")
    assert run(Ranks(args, 2), log) == 0, tail(log)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return reference(tmp_path_factory, "spot-uninterrupted")


@pytest.fixture(scope="module")
def uninterrupted_fsdp(tmp_path_factory) -> Path:
    return reference(tmp_path_factory, "spot-uninterrupted-fsdp", *FSDP)


def lose_all(procs: list, run_dir: Path, after: int, log: Path, starts: int) -> None:
    """Every process of the run SIGKILLed once it started for the `starts`-th time (the metrics
    of the run before are cut back at a start) and rank 0 logged step `after`."""
    try:
        deadline = time.monotonic() + 120
        while len(events(run_dir, "start", missing_ok=True)) < starts:
            assert procs[0].poll() is None and time.monotonic() < deadline, tail(log)
            time.sleep(0.05)
        wait_step(procs[0], run_dir, after, log)
    finally:
        for proc in procs:
            kill_tree(proc.pid)
        for proc in procs:
            proc.wait(60)


def wait_held(copies: list[tuple[Path, str]], step: int, log: Path) -> None:
    """Wait until each (node's local folder, folder of the run in it) holds `step`."""
    deadline = time.monotonic() + 60
    while not all(step in steps_in(next(local.iterdir()) / name) for local, name in copies):
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.05)


def one_process(run_dir: Path, local: Path, log: Path, *extra: str):
    """The survivor going on alone: `harness train` as one process, its local tier in `local`."""
    return start([HARNESS, "train", str(SPOT), "--run-dir", str(run_dir), *COMMON, *CADENCE, *extra, "--set",
                  f"checkpoint.local.dir='{local}'"], log)


def resumed(run_dir: Path) -> dict:
    return events(run_dir, "start")[-1]


def assert_bitwise(uninterrupted: Path, run_dir: Path) -> None:
    assert losses_of(run_dir) == losses_of(uninterrupted) and sorted(losses_of(run_dir)) == list(range(1, STEPS + 1))
    assert bitwise_differences(uninterrupted, run_dir, STEPS) == []
    assert not events(run_dir, "resume_mismatch")


def test_two_to_one_to_two_and_a_second_loss_lose_at_most_the_local_interval_bitwise(tmp_path, uninterrupted):
    """World 2, both nodes die after step 7 and node 1's disk is gone: node 0 goes on alone from its
    own local step 6 (not persistent 4). It dies after step 11; a fresh node joins (world 2): the
    newest step is node 0's world-1 local 10, which node 1 receives. Right after that resume (the
    first new step) both die again and node 0's disk is gone now: node 1 holds step 10 (the copy
    it received and the re-replicated one), and the run resumes there, finishes, and is bitwise
    the uninterrupted run at world size 2."""
    run_dir = tmp_path / "run"
    node0, node1 = tmp_path / "node0-local", tmp_path / "node1-local"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]

    lose_all(agents(run_dir, [node0, node1], logs, config=SPOT), run_dir, 7, logs[0], starts=1)
    assert resumed(run_dir)["exact_elastic"] and resumed(run_dir)["exact_elastic_why"].startswith("auto: every")
    shutil.rmtree(node1)

    alone = tmp_path / "alone.log"
    lose_all([one_process(run_dir, node0, alone)], run_dir, 11, alone, starts=2)
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "local", 1, 2), start_b
    assert start_b["exact_elastic"]

    nodes = agents(run_dir, [node0, node1], logs, config=SPOT)
    lose_all(nodes, run_dir, 11, logs[0], starts=3)  # the step after the resume at 10
    start_c = resumed(run_dir)
    assert (start_c["resumed_from"], start_c["resumed_tier"], start_c["saved_world_size"]) == (10, "peer", 1), start_c
    shutil.rmtree(node0)

    for node in agents(run_dir, [node0, node1], logs, config=SPOT):
        assert node.wait(300) == 0, tail(logs[0]) + tail(logs[1])
    start_d = resumed(run_dir)
    assert (start_d["resumed_from"], start_d["resumed_tier"], start_d["saved_world_size"]) == (10, "peer", None)
    assert_bitwise(uninterrupted, run_dir)
    report = harness("report", str(run_dir), check=True).stdout
    assert "step 6 from the local tier" in report and "step 10 from the peer tier" in report, report


def test_fsdp_two_to_one_to_two_reads_the_shards_of_both_copies_bitwise(tmp_path, uninterrupted_fsdp):
    """FSDP, world 2: both die after step 7, once node 0 holds node 1's peer copy of step 6, and
    node 1's disk is gone. The survivor reads its (whole) share of every sharded weight from its
    own copy and that peer copy together, resharded by DCP, at world size 1; it dies after step
    11; a fresh node joins and receives node 0's world-1 copy of 10. Bitwise the uninterrupted
    world-2 FSDP run."""
    run_dir = tmp_path / "run"
    node0, node1 = tmp_path / "node0-local", tmp_path / "node1-local"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = agents(run_dir, [node0, node1], logs, *FSDP, config=SPOT)
    try:
        wait_step(nodes[0], run_dir, 7, logs[0])
        wait_held([(node0, "peer-of-rank-00001")], 6, logs[0])
    finally:
        lose_all(nodes, run_dir, 7, logs[0], starts=1)
    shutil.rmtree(node1)

    alone = tmp_path / "alone.log"
    lose_all([one_process(run_dir, node0, alone, *FSDP)], run_dir, 11, alone, starts=2)
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "peer", 1, 2), start_b

    for node in agents(run_dir, [node0, node1], logs, *FSDP, config=SPOT):
        assert node.wait(300) == 0, tail(logs[0]) + tail(logs[1])
    start_c = resumed(run_dir)
    assert (start_c["resumed_from"], start_c["resumed_tier"], start_c["saved_world_size"]) == (10, "peer", 1), start_c
    assert "model sharded with FSDP2" in logs[0].read_text()
    assert_bitwise(uninterrupted_fsdp, run_dir)


def test_four_to_two_resumes_from_the_survivors_own_copies_bitwise(tmp_path, uninterrupted):
    """Two nodes of two ranks (world 4; peer copies go to the other node), both die after step 7
    and node 1's disk is gone: node 0's two ranks go on at world size 2 from their own local
    step 6, written at world size 4."""
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    lose_all(agents(run_dir, locals_, logs, config=SPOT, nproc=2), run_dir, 7, logs[0], starts=1)
    shutil.rmtree(locals_[1])
    (node,) = agents(run_dir, locals_[:1], logs[:1], config=SPOT, nproc=2)
    assert node.wait(300) == 0, tail(logs[0])
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "local", 2, 4), start_b
    assert_bitwise(uninterrupted, run_dir)


def test_fsdp_four_to_two_reads_the_lost_nodes_shards_from_its_peer_copies_bitwise(tmp_path, uninterrupted_fsdp):
    """FSDP, two nodes of two ranks (world 4; each rank's peer copy goes to the other node): both
    die after step 7, once node 0 holds its peer copies of ranks 2 and 3 of step 6, and node 1's
    disk is gone. Node 0's two ranks go on at world size 2 from step 6, each reading its new share
    of every sharded weight from the four ranks' copies (two their own, two peer copies),
    resharded by DCP; bitwise the uninterrupted world-2 FSDP run."""
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = agents(run_dir, locals_, logs, *FSDP, config=SPOT, nproc=2)
    try:
        wait_step(nodes[0], run_dir, 7, logs[0])
        wait_held([(locals_[0], "peer-of-rank-00002"), (locals_[0], "peer-of-rank-00003")], 6, logs[0])
    finally:
        lose_all(nodes, run_dir, 7, logs[0], starts=1)
    shutil.rmtree(locals_[1])
    (node,) = agents(run_dir, locals_[:1], logs[:1], *FSDP, config=SPOT, nproc=2)
    assert node.wait(300) == 0, tail(logs[0])
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "peer", 2, 4), start_b
    assert_bitwise(uninterrupted_fsdp, run_dir)


def test_fsdp_four_nodes_to_two_losing_nodes_1_and_3_reads_the_copies_a_node_wrote_under_its_old_rank(
        tmp_path, uninterrupted_fsdp):
    """FSDP, four nodes of one rank (world 4; rank r's peer copies go to rank r + 1): all die after
    step 7, once node 0 holds its peer copy of rank 3's step 6 and node 2 of rank 1's, and nodes 1
    and 3 are gone with their disks. Nodes 0 and 2 go on as ranks 0 and 1 of world 2: rank 2's
    shards of step 6 survive in the folder node 2 wrote them in as rank 2, so step 6 is whole (two
    own copies, two peer copies; each rank sends the other the two it lacks), not persistent 4."""
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / f"node{node}-local" for node in range(4)]
    logs = [tmp_path / f"node{node}.log" for node in range(4)]
    nodes = agents(run_dir, locals_, logs, *FSDP, *SLOW, config=SPOT)
    try:
        wait_step(nodes[0], run_dir, 7, logs[0])
        wait_held([(locals_[0], "peer-of-rank-00003"), (locals_[2], "peer-of-rank-00001")], 6, logs[0])
    finally:
        lose_all(nodes, run_dir, 7, logs[0], starts=1)
    for lost in (1, 3):
        shutil.rmtree(locals_[lost])
    survivors = [0, 2]
    for node in agents(run_dir, [locals_[n] for n in survivors], [logs[n] for n in survivors], *FSDP, config=SPOT):
        assert node.wait(300) == 0, tail(logs[0]) + tail(logs[2])
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "peer", 2, 4), start_b
    assert not events(run_dir, "checkpoint_rejected", missing_ok=True)
    assert_bitwise(uninterrupted_fsdp, run_dir)


@pytest.mark.parametrize("arm", ["ddp", "fsdp"])
def test_losing_node_0_then_a_regrow_read_the_copies_node_1_wrote_under_its_other_rank_bitwise(tmp_path, arm,
                                                                                                request):
    """World 2; both die after step 7 and node 0 is gone with its disk. Node 1 goes on alone, as
    rank 0, from step 6 (not persistent 4): DDP with peer copies off (as when its copy of rank 0's
    step 6 was still on the way) from the copy it wrote as rank 1; FSDP from the union of that
    copy's shards and its peer copy of rank 0's. It dies after step 11; node 0 comes back with an
    empty disk and node 1 is rank 1 again: the newest step is 10 (not persistent 8), which node 1
    wrote as rank 0 of world 1, and node 0 receives it. Bitwise the uninterrupted world-2 run."""
    run_dir = tmp_path / "run"
    node0, node1 = tmp_path / "node0-local", tmp_path / "node1-local"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    extra = NO_PEERS if arm == "ddp" else FSDP
    nodes = agents(run_dir, [node0, node1], logs, *extra, *SLOW, config=SPOT)
    try:
        wait_step(nodes[0], run_dir, 7, logs[0])
        if arm == "fsdp":
            wait_held([(node1, "peer-of-rank-00000")], 6, logs[0])
    finally:
        lose_all(nodes, run_dir, 7, logs[0], starts=1)
    shutil.rmtree(node0)

    alone = tmp_path / "alone.log"
    lose_all([one_process(run_dir, node1, alone, *extra)], run_dir, 11, alone, starts=2)
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "peer", 1, 2), start_b

    for node in agents(run_dir, [node0, node1], logs, *extra, config=SPOT):
        assert node.wait(300) == 0, tail(logs[0]) + tail(logs[1])
    start_c = resumed(run_dir)
    assert (start_c["resumed_from"], start_c["resumed_tier"], start_c["world_size"], start_c["saved_world_size"]) \
        == (10, "peer", 2, 1), start_c
    assert not events(run_dir, "checkpoint_rejected", missing_ok=True)
    assert_bitwise(request.getfixturevalue("uninterrupted" if arm == "ddp" else "uninterrupted_fsdp"), run_dir)


def test_outside_exact_mode_a_shrink_resumes_from_the_local_tier_within_the_elastic_promise(tmp_path):
    """`parallel.exact_elastic = false`, world 2 -> 1 with node 1's disk gone: the survivor's own
    local step 6 serves (its random streams are restarted for the new world size, as a persistent
    resume at another world size restarts them); the start event says the mode and why."""
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    off = ["--set", "parallel.exact_elastic=false"]
    lose_all(agents(run_dir, locals_, logs, *off, config=SPOT), run_dir, 7, logs[0], starts=1)
    shutil.rmtree(locals_[1])
    alone = tmp_path / "alone.log"
    proc = start([HARNESS, "train", str(SPOT), "--run-dir", str(run_dir), *COMMON, *CADENCE, *off, "--set",
                  f"checkpoint.local.dir='{locals_[0]}'"], alone)
    try:
        assert proc.wait(300) == 0, tail(alone)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["saved_world_size"]) == (6, "local", 2)
    assert (start_b["exact_elastic"], start_b["exact_elastic_why"]) == (False, "parallel.exact_elastic = false")
    assert [e["new_world_size"] for e in events(run_dir, "world_size_changed")] == [1]


def test_torchrun_elastic_survivor_goes_on_from_its_local_copy_without_a_restart_from_zero(tmp_path, uninterrupted):
    """Two torchrun agents in an elastic group (NNODES=1:2, ops/torchrun/train.sh, a rendezvous
    store no node hosts), one rank each, each node with its own local folder. The node of rank 0
    is lost after step 7 (SIGKILL of its agent and worker, its disk deleted); nothing is started
    again by hand: the survivor's torchrun re-forms the group at world size 1 and its new worker
    resumes from its own local step 6 (not persistent 4) and finishes bitwise the uninterrupted
    world-size-2 run."""
    port = free_port()
    store = spawn([sys.executable, str(ROOT / "ops/torchrun/rendezvous_store.py"), "--host", "127.0.0.1",
                   "--port", str(port)], stdout=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    env = {"NNODES": "1:2", "NPROC": "1", "MAX_RESTARTS": "3", "RUN_DIR": str(run_dir),
           "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": "spot-test",
           "RDZV_CONF": "is_host=false,last_call_timeout=2"}
    try:
        assert "listening" in store.stdout.readline()
        # Slow steps (not part of the math): the kill after step 7 lands before step 8's checkpoints
        # however long finding and killing the node's processes takes on a loaded machine.
        nodes = [start([str(ROOT / "ops/torchrun/train.sh"), str(SPOT), *COMMON, *CADENCE, "--set",
                        "debug.step_sleep_s=0.5", "--set", f"checkpoint.local.dir='{local}'"], log, env)
                 for local, log in zip(locals_, logs, strict=True)]
        try:
            wait_step(nodes[0], run_dir, 7, logs[0])
            lost = agent_of_rank(nodes, 0)
            kill_tree(lost.pid)
            lost.wait(60)
            shutil.rmtree(locals_[nodes.index(lost)])
            survivor = nodes[1 - nodes.index(lost)]
            assert survivor.wait(300) == 0, tail(logs[nodes.index(survivor)])
        finally:
            for node in nodes:
                if node.poll() is None:
                    kill_tree(node.pid)
                    node.wait(60)
    finally:
        store.kill()
        store.wait()
    start_b = resumed(run_dir)
    assert (start_b["resumed_from"], start_b["resumed_tier"], start_b["world_size"], start_b["saved_world_size"]) \
        == (6, "local", 1, 2), start_b
    assert_bitwise(uninterrupted, run_dir)
