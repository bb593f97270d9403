"""Where this process sits in a job, as the launcher put it in the environment.

torchrun, or SLURM through ops/slurm/train.sbatch, sets RANK, WORLD_SIZE and LOCAL_RANK; a plain
`harness train` is rank 0 of 1. Reading it needs no torch, so the commands that only decide
(`harness train --max-restarts` as a supervisor) start without it; joining the group is
harness/parallel/distributed.py. `process_cores` is where on the machine: the cores a thread may
run on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its global rank, the world size, its rank on this node, and the
    number of ranks on this node (unknown to the launcher: all of them)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def process_cores() -> list[int]:
    """The cores the calling thread may run on, in order: the process's own, unless the thread was
    held on fewer (checkpoint/save/writer_cores.py)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def topology_from_env(env: Mapping[str, str] | None = None) -> Topology:
    """The topology torchrun (or SLURM through ops/slurm/train.sbatch) put in the environment."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", 1))
    return Topology(int(env.get("RANK", 0)), world, int(env.get("LOCAL_RANK", 0)),
                    int(env.get("LOCAL_WORLD_SIZE", world)))
