"""`harness train` at world size > 1 for the distributed tests: start, find a rank's process, kill.

Two ways to start a group. `torchrun(...)`: the launcher users run, for the tests of what torchrun
does (restarts, a rank or agent killed, signals, node loss: test_torchrun.py, test_launchers.py),
forked by the session's fork server; each worker it starts is a relay that has the server fork the
real rank (harness/forkserver/relay.py), and `rank_process` finds the relay, the process torchrun
knows (procs.relayed: the rank behind it). `Ranks` (what `train_args` and `fsdp_args` give): the
ranks alone, each a `harness` process (or a worker script) forked by the session's fork server
(tests/procs.py) with the environment torchrun gives its workers, for the tests of what the ranks do
(checkpoints, resume, tiers, the collectives), without a launcher and a relay per rank. `start` and
`run` take either; `kill_all` kills either at once, as a lost node goes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.checkpoint.manifest import MANIFEST_FILE
from procs import ENV, ROOT, TINY, final_checkpoint, last_step, spawn

# torchrun shares its rendezvous store with the workers' process group by default, and a
# restarted group then reads the previous group's gloo addresses (pytorch/pytorch#135712):
# the launchers in ops/ set this too.
TORCHRUN_ENV = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}"}  # torchrun, harness

HARNESS = str(Path(sys.executable).with_name("harness"))
# Muon under DDP in every run: its orthogonalisation must see the all-reduced gradient.
COMMON = ["--set", "optim.type=muon"]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a rendezvous or a master port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    """torchrun's command line for `harness ARGS` on `nproc` ranks of this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--no-python", HARNESS, *args]


@dataclass(frozen=True)
class Ranks:
    """`harness ARGS` (with `script`: `python SCRIPT ARGS`, a worker of the tests) as the `nproc`
    ranks of one group on this machine, without a launcher."""

    args: tuple[str, ...]
    nproc: int = 2
    script: str | None = None

    def command(self) -> list[str]:
        return [sys.executable, *([self.script] if self.script else ["-m", "harness.cli"]), *self.args]


def train_cli(run_dir: Path, *extra: str) -> list[str]:
    """The `harness` arguments of a training of the tiny config with Muon."""
    return ["train", str(TINY), "--run-dir", str(run_dir), *COMMON, *extra]


def train_args(run_dir: Path, *extra: str, nproc: int = 2) -> Ranks:
    return Ranks(tuple(train_cli(run_dir, *extra)), nproc)


def fsdp_sets(arm: str) -> list[str]:
    """The `--set`s of an FSDP run with the optimizer `arm`."""
    return ["--set", "parallel.strategy=fsdp", "--set", f"optim.type={arm}"]


def fsdp_args(run_dir: Path, arm: str, *extra: str) -> Ranks:
    """`harness train` of the tiny config with FSDP at world size 2, optimizer `arm`."""
    return Ranks(("train", str(TINY), "--run-dir", str(run_dir), *fsdp_sets(arm), *extra))


class RankGroup:
    """The running ranks of a `Ranks`, kept as torchrun's agent keeps its workers: `poll` and
    `wait` give 0 once every rank exited 0, else the first failed rank's code, and the ranks
    still running after a rank failed are killed (SIGKILL) if they have not ended within
    `FAILED_PEER_GRACE_S` (a rank whose peer is gone fails its next collective by itself)."""

    FAILED_PEER_GRACE_S = 60

    def __init__(self, ranks: Ranks, log: Path, env: dict[str, str] | None):
        port, world = str(free_port()), str(ranks.nproc)
        with log.open("ab") as out:
            self.ranks = [spawn(ranks.command(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**ENV, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                     "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                          for rank in range(ranks.nproc)]
        self.args = ranks.args
        self.returncode: int | None = None
        self._failed_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = [rank.poll() for rank in self.ranks]
            failed = [code for code in codes if code not in (None, 0)]
            if failed and None in codes:
                self._failed_at = self._failed_at or time.monotonic()
                if time.monotonic() - self._failed_at > self.FAILED_PEER_GRACE_S:
                    self.kill()
            elif failed:
                self.returncode = failed[0]
            elif None not in codes:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank at once."""
        for rank in self.ranks:
            rank.kill()


def start(args: list[str] | Ranks, log: Path, env: dict[str, str] | None = None,
          new_session: bool = False) -> subprocess.Popen | RankGroup:
    """Start a command line (or `Ranks`) with its output in `log` (a file: a pipe nobody reads
    would block it); `new_session`: in a process group of its own, as a terminal's job or
    ops/torchrun/train.sh starts torchrun."""
    if isinstance(args, Ranks):
        return RankGroup(args, log, env)
    with log.open("ab") as out:
        return spawn(args, stdout=out, stderr=subprocess.STDOUT, env={**TORCHRUN_ENV, **(env or {})}, cwd=ROOT,
                     start_new_session=new_session)


def run(args: list[str] | Ranks, log: Path, timeout: float = 300, env: dict[str, str] | None = None) -> int:
    proc = start(args, log, env)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            kill_all(proc)


def kill_all(proc: subprocess.Popen | RankGroup) -> None:
    """SIGKILL a group at once: the ranks of a `RankGroup`, or a launcher and every process under it."""
    if isinstance(proc, RankGroup):
        proc.kill()
    else:
        kill_tree(proc.pid)


def rank_process(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> psutil.Process:
    """The worker process of `rank` under a torchrun started as `launcher`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in child.environ():
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no worker process of rank {rank} within {timeout}s")


def agent_of_rank(agents: list[subprocess.Popen], rank: int) -> subprocess.Popen:
    """The torchrun agent (of several, an elastic group's nodes) whose worker now has `rank`."""
    for agent in agents:
        for child in psutil.Process(agent.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if child.environ().get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in child.environ():
                    return agent
    raise AssertionError(f"no agent runs rank {rank}")


def kill_tree(pid: int, sig: int = 9) -> None:
    """Signal a launcher and every process under it at once (a lost node)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def wait_step(proc: subprocess.Popen | RankGroup, run_dir: Path, step: int, log: Path, timeout: float = 180,
              committed: int | None = None) -> None:
    """Wait until rank 0 logged `step` in metrics.jsonl and, with `committed`, the checkpoint of
    that step is committed too: a background save can still be in flight steps later on a busy
    machine, and a kill then finds no checkpoint to resume from."""
    deadline = time.monotonic() + timeout
    manifest = None if committed is None else final_checkpoint(run_dir, committed) / MANIFEST_FILE
    while last_step(run_dir) < step or (manifest is not None and not manifest.exists()):
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before step {step}:\n{tail(log)}")
        if time.monotonic() > deadline:
            kill_all(proc)
            raise AssertionError(f"no step {step} within {timeout}s:\n{tail(log)}")
        time.sleep(0.02)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""
