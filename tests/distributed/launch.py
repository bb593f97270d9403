"""`harness train` under torchrun for the distributed tests: start, find a rank's process, kill."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from harness.checkpoint.manifest import MANIFEST_FILE
from procs import ENV, ROOT, TINY, final_checkpoint, last_step

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


def torchrun(*script: str, nproc: int = 2, max_restarts: int = 0, python: bool = False) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", str(max_restarts)]
    return [*launcher, *script] if python else [*launcher, "--no-python", HARNESS, *script]


def train_args(run_dir: Path, *extra: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return torchrun("train", str(TINY), "--run-dir", str(run_dir), *COMMON, *extra, nproc=nproc,
                    max_restarts=max_restarts)


def fsdp_sets(arm: str) -> list[str]:
    """The `--set`s of an FSDP run with the optimizer `arm`."""
    return ["--set", "parallel.strategy=fsdp", "--set", f"optim.type={arm}"]


def fsdp_args(run_dir: Path, arm: str, *extra: str) -> list[str]:
    """`harness train` of the tiny config with FSDP at world size 2, optimizer `arm`."""
    return torchrun("train", str(TINY), "--run-dir", str(run_dir), *fsdp_sets(arm), *extra)


def start(args: list[str], log: Path, env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen:
    """Start a command with its output in `log` (a file: a pipe nobody reads would block it);
    `new_session`: in a process group of its own, as a terminal's job or ops/torchrun/train.sh
    starts torchrun."""
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**TORCHRUN_ENV, **(env or {})},
                                cwd=ROOT, start_new_session=new_session)


def run(args: list[str], log: Path, timeout: float = 300, env: dict[str, str] | None = None) -> int:
    proc = start(args, log, env)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
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


def kill_tree(pid: int, sig: int = 9) -> None:
    """Signal a launcher and every process under it at once (a lost node)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def wait_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 180,
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
            kill_tree(proc.pid)
            raise AssertionError(f"no step {step} within {timeout}s:\n{tail(log)}")
        time.sleep(0.02)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""
