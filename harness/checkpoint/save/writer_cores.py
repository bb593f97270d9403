"""The cores a process's background checkpoint work runs on (`checkpoint.writer_cores`).

Why: a background save streams the state through memory and the disk while the steps go on. On
this project's 2-core VM, with one training thread (`train.cpu_threads=1`), a step beside a save
of 2 GiB took 1.03-1.19x its time alone while the writer's threads ran wherever the kernel put
them, 1.02-1.05x with them held on the core that takes the disk's interrupts, and 1.21-1.25x with
them held on the other core (docs/bench-scale.md, fifth pass). A disk's completions wake the writer on
the core its interrupts go to (one core for a VM's single-queue disk; the submitting core for a
multi-queue NVMe), and the training thread there is the one that gives way.

Contract:
- `place_writers(setting, training_threads)` runs once per training process, after torch's thread
  count is fixed (`harness.repro.numerics.apply`); it decides the cores and returns them (None:
  no placement). `"auto"`: when the training threads of this node leave cores of this process's
  affinity free, those cores, the ones that took the most device interrupts first
  (/proc/interrupts); none are left: no placement. `"any"`: no placement. A list: those cores,
  each one this process may run on (`UserError` otherwise).
- `enter()` runs first in each background job's thread (background.py): it holds that thread on
  the placed cores, and every thread it starts (its hash and write pools) inherits them. The
  training thread, torch's threads and the state passes at the step boundary are left alone.
  Where the kernel refuses the placement (the process's cores changed), one warning, and the job
  runs where it may: a save never fails for where it runs.
- Nothing here changes a result: the placement is not part of a run's math.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from harness.errors import UserError
from harness.log import get_logger
from harness.topology import process_cores

log = get_logger(__name__)

INTERRUPTS = Path("/proc/interrupts")

_placed: frozenset[int] | None = None
_warned = False


def device_interrupts(text: str) -> dict[int, int]:
    """Interrupts each core has taken from devices (the numbered lines of /proc/interrupts, not
    the per-core timer, IPI and other named lines), by core number."""
    lines = text.splitlines()
    if not lines:
        return {}
    cpus = [int(name[3:]) for name in lines[0].split() if name.startswith("CPU")]
    counts = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        if not label.strip().isdigit():
            continue
        fields = rest.split()
        for cpu, field in zip(cpus, fields, strict=False):
            if not field.isdigit():
                break
            counts[cpu] += int(field)
    return counts


def free_cores(cores: Sequence[int], training_threads: int, interrupts: dict[int, int]) -> frozenset[int] | None:
    """The `len(cores) - training_threads` cores of `cores` that took the most device interrupts
    (ties: the higher-numbered), or None when the training threads take every core."""
    spare = len(cores) - training_threads
    if spare < 1:
        return None
    ranked = sorted(cores, key=lambda core: (interrupts.get(core, 0), core), reverse=True)
    return frozenset(ranked[:spare])


def _read_interrupts() -> dict[int, int]:
    try:
        return device_interrupts(INTERRUPTS.read_text())
    except OSError:  # not Linux, or /proc not mounted: the ranking falls to the core numbers
        return {}


def choose(setting: str | list[int], training_threads: int) -> frozenset[int] | None:
    """The cores `setting` (`checkpoint.writer_cores`) names for this process; see the contract."""
    cores = process_cores()
    placeable = hasattr(os, "sched_setaffinity")  # Linux
    if setting == "any" or (setting == "auto" and not placeable):
        return None
    if setting == "auto":
        return free_cores(cores, training_threads, _read_interrupts())
    assert isinstance(setting, list)  # the config's type: "auto" | "any" | list of core numbers
    if not placeable:
        raise UserError("checkpoint.writer_cores: this platform cannot hold threads on cores; set it to \"auto\"")
    outside = sorted(set(setting) - set(cores))
    if outside:
        raise UserError(f"checkpoint.writer_cores names core(s) {outside} this process may not run on (it may run on "
                        f"{cores}); name some of those, or set it to \"auto\"")
    return frozenset(setting)


def place_writers(setting: str | list[int], training_threads: int) -> frozenset[int] | None:
    """Decide where this process's background jobs run (`choose`) and keep it for `enter`; returns
    the cores, or None for no placement."""
    global _placed
    _placed = choose(setting, training_threads)
    return _placed


def enter() -> None:
    """Hold the calling thread (a background job's) on the placed cores, if any."""
    global _warned
    if _placed is None:
        return
    try:
        os.sched_setaffinity(0, _placed)
    except OSError as e:
        if not _warned:
            _warned = True
            log.warning("background checkpoint work runs on any core: the placement was refused",
                        cores=sorted(_placed), error=str(e))
