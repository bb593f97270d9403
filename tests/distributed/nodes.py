"""Two nodes of one rank each, as two torchrun agents on this machine, each with its own local
folder (the local tier's peer copies: tests/distributed/test_peer_copies.py, test_local_tier_fsdp.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from launch import COMMON, HARNESS, free_port, kill_tree, start, tail, wait_step
from procs import TINY

# Persistent every 4 steps (4, 8, 12), local every 2 where no persistent save is due (2, 6, 10):
# a loss after step 7 finds persistent 4 and local 6.
CADENCE = ["--set", "checkpoint.every_steps=4", "--set", "checkpoint.async_save=false",
           "--set", "checkpoint.local.every_steps=2"]


def agents(run_dir: Path, locals_: list[Path], logs: list[Path], *extra: str, config: Path = TINY,
           nproc: int = 1, common: tuple[str, ...] = tuple(COMMON), env: dict[str, str] | None = None) -> list:
    """One torchrun agent per local folder (node ranks 0, 1, ...), `nproc` ranks each, meeting at
    a static rendezvous on localhost, training `config` with `common` (Muon), `CADENCE` and
    `extra` (in `env`, over the launcher's); node i's local tier is in `locals_[i]`."""
    port, nodes = str(free_port()), len(locals_)
    return [start([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", port,
                   "--max-restarts", "0", "--no-python", HARNESS, "train", str(config), "--run-dir", str(run_dir),
                   *common, *CADENCE, *extra, "--set", f"checkpoint.local.dir='{locals_[node]}'"], logs[node],
                  env)
            for node in range(nodes)]


def steps_in(folder: Path) -> set[int]:
    """The committed steps of one rank's (or one peer's) local folder."""
    return {int(p.name.removeprefix("step-")) for p in (folder / "checkpoints").glob("step-*")}


def node_0_lost(tmp_path: Path, *extra: str) -> tuple[Path, list[Path], list[Path]]:
    """Both nodes trained past step 7, then node 0 SIGKILLed (agent and worker) and node 1's
    worker gone with it: (run dir, local folders, logs)."""
    run_dir = tmp_path / "run"
    locals_ = [tmp_path / "node0-local", tmp_path / "node1-local"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = agents(run_dir, locals_, logs, *extra)
    try:
        wait_step(nodes[0], run_dir, 7, logs[0])
        kill_tree(nodes[0].pid)
        nodes[0].wait(60)
        assert nodes[1].wait(120) != 0, tail(logs[1])
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
                node.wait(60)
    return run_dir, locals_, logs


def restart(run_dir: Path, locals_: list[Path], logs: list[Path], *extra: str) -> None:
    """Both nodes started again (`--resume auto`), each to a clean exit."""
    nodes = agents(run_dir, locals_, logs, *extra)
    try:
        for node, log in zip(nodes, logs, strict=True):
            assert node.wait(300) == 0, tail(log)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
