"""The relay (harness/forkserver/relay.py): a `harness` process started as a fresh interpreter with a
fork server named in its environment has the server fork the real process and stands in for it:
the same output and exit code, signals passed on, killed by the signal that killed the child, and
the child SIGKILLed the moment the relay dies, however it dies, even while the child is stuck in a
step. Where the server cannot serve, the relay runs the command itself. One server for the module
(not the session's), so the tests know which server forks."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from harness.forkserver.client import ForkServer
from harness.forkserver.relay import SERVER_ENV
from procs import ENV, ROOT, TINY, assert_same_run, events, relayed, wait_for_step

LONG = ["--set", "train.steps=400"]
# ENV holds what torch's deterministic mode put in this process's environment (tests/conftest.py);
# a server started without it has its imports set it, and its children's own children then come
# with it: they must be served all the same.
IMPORTED = "TORCHINDUCTOR_CACHE_DIR"


@pytest.fixture(scope="module")
def server():
    folder = tempfile.mkdtemp(prefix="harness-fs-")
    started = ForkServer({k: v for k, v in ENV.items() if k != IMPORTED}, ROOT, folder)
    yield started
    started.close()
    shutil.rmtree(folder)


def relay(server: ForkServer, *args: str, env: dict = ENV) -> subprocess.Popen:
    """`harness ARGS` as a launcher starts it: a fresh interpreter, here with `server` named."""
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, SERVER_ENV: server.socket_path}, cwd=ROOT)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def started_by(run_dir) -> int:
    """The pid of the process that trained in `run_dir` (its start event)."""
    return events(run_dir, "start")[-1]["pid"]


def test_the_servers_child_does_the_work_and_the_relay_ends_as_it_does(tmp_path, server, continuous):
    run = tmp_path / "run"
    proc = relay(server, "train", str(TINY), "--run-dir", str(run))
    assert finish(proc)[0] == 0, proc.stderr
    assert started_by(run) != proc.pid
    assert_same_run(continuous, run, 12)
    bad = ["train", str(TINY), "--set", "optim.lrr=1"]
    assert finish(relay(server, *bad)) == finish(server.popen([sys.executable, "-m", "harness.cli", *bad],
                                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                              text=True, env=ENV, cwd=ROOT))


def test_a_signal_to_the_relay_reaches_the_child_and_a_signal_that_kills_the_child_kills_the_relay(tmp_path, server):
    run = tmp_path / "run"
    proc = relay(server, "train", str(TINY), "--run-dir", str(run), *LONG)
    wait_for_step(proc, run, 2)
    assert psutil.Process(proc.pid).children() == [], "the relay started the command itself"
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 75 and "received SIGTERM" in err, err
    assert [e["reason"] for e in events(run, "exit")] == ["preempted"]
    proc = relay(server, "train", str(TINY), "--run-dir", str(run), *LONG)
    wait_for_step(proc, run, 6)
    psutil.Process(started_by(run)).kill()
    assert finish(proc)[0] == -signal.SIGKILL


def test_the_child_dies_with_its_relay_even_stuck_in_a_step(tmp_path, server):
    """The child sleeps inside step 3 (no watchdog to end it) when its relay is SIGKILLed: nothing
    reaches the child from the relay, and it is gone all the same."""
    run = tmp_path / "run"
    proc = relay(server, "train", str(TINY), "--run-dir", str(run), *LONG, "--set", "health.hang_watchdog=false",
                 "--set", "debug.hang_at_step=3")
    wait_for_step(proc, run, 2)
    child = relayed(psutil.Process(proc.pid))
    assert child.pid == started_by(run) != proc.pid
    proc.kill()
    finish(proc)
    assert child.wait(60) is None  # not our child: psutil can only tell that it is gone
    assert events(run, "exit") == [], "the child ended by itself"


def test_where_the_server_cannot_serve_the_relay_runs_the_command_itself(tmp_path, server):
    """An environment the server cannot honour (MKL's mode, read when torch loads), or no server
    at the path named."""
    run = tmp_path / "run"
    own_mode = relay(server, "train", str(TINY), "--run-dir", str(run), "--set", "train.steps=1",
                     env={**ENV, "MKL_CBWR": "AUTO"})
    code, _, err = finish(own_mode)
    assert code == 0 and "MKL_CBWR in the environment is not strict" in err, err
    assert started_by(run) == own_mode.pid
    gone = subprocess.run([sys.executable, "-m", "harness.cli", "--help"], capture_output=True, text=True,
                          env={**ENV, SERVER_ENV: str(tmp_path / "no-server.sock")}, cwd=ROOT, timeout=300)
    assert gone.returncode == 0 and "usage: harness" in gone.stdout, gone.stderr


def test_a_served_supervisors_children_relay_and_die_with_it(tmp_path, server):
    """`harness train --max-restarts` forked by the server starts its child as a fresh interpreter,
    which relays to the same server (its environment carries what the server's imports set); a
    SIGKILLed supervisor takes the relay (PR_SET_PDEATHSIG) and the relay its child."""
    run = tmp_path / "run"
    supervisor = server.popen([sys.executable, "-m", "harness.cli", "train", str(TINY), "--run-dir", str(run),
                               "--max-restarts", "1", *LONG], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**ENV, SERVER_ENV: server.socket_path}, cwd=ROOT)
    assert supervisor.forked and IMPORTED in ENV
    wait_for_step(supervisor, run, 2)
    [child] = psutil.Process(supervisor.pid).children()
    worker = relayed(child)
    assert worker.pid == started_by(run) not in (child.pid, supervisor.pid)
    supervisor.kill()
    finish(supervisor)
    assert child.wait(60) is None and worker.wait(60) is None


def test_a_forked_torchrun_starts_relays_whose_ranks_the_server_forks(tmp_path, server):
    """torchrun's launcher is a module a server runs too; the workers it starts are fresh
    interpreters, relays, and the ranks that train are the server's children, although their
    environment holds what torchrun adds and what ops/torchrun/train.sh exports (TORCH_*)."""
    run = tmp_path / "run"
    env = {**ENV, SERVER_ENV: server.socket_path, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    launcher = server.popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "harness.cli", "train", str(TINY), "--run-dir", str(run), *LONG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert launcher.forked
    wait_for_step(launcher, run, 2)
    workers = psutil.Process(launcher.pid).children()
    ranks = [relayed(worker) for worker in workers]
    assert len(workers) == 2 and {rank.ppid() for rank in ranks} == {server.process.pid}
    launcher.send_signal(signal.SIGTERM)
    code, _, err = finish(launcher)
    assert code != 0 and [e["reason"] for e in events(run, "exit")] == ["preempted"], err[-3000:]
