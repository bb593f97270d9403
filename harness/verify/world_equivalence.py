"""`harness verify-resume CONFIG --world-sizes 2,1[,4]`: check a run resumed at other world sizes.

The runner trains the config twice in a scratch folder, in real `harness train` processes (one
process at world size 1, torchrun with N ranks above it): A continuously at the first world size;
B starting at it too, interrupted once it logged each interruption step (SIGKILL of the launcher
and every rank, or SIGTERM: a preemption) and resumed at the next world size each time, then run
to the end at the last one. Then it compares, against what docs/distributed.md promises for a
change of world size:
1. the global batch of every step (the hash of its sample ids in cursor order, the same for any
   world size): must be identical at every step;
2. the loss of every step both runs logged: max |A - B| / max(1, |A|) must be within the
   tolerance; the verdict says over how many steps, how many of them had different batches
   (their losses differ for that reason as well) and which steps one run did not log;
3. the final checkpoints: every model and optimizer tensor within the tolerance (max |A - B|),
   compared whole where either run stored it sharded (FSDP: assembled from its shards,
   checkpoint/diff.py), so the two may have been written by different world sizes or strategies; everything else equal
   (data cursor, schedulers, step and token counters), except what a change of world size
   changes on purpose: the random streams (restarted for the new world size), the loss digest
   and fingerprint history (they hash the losses bit for bit; fingerprints hash a rank's own
   shards), the per-rank files of ranks one run has and the other lacks, and the saved meta
   (world size, environment fingerprint: never compared);
4. that B did change its world size: a `world_size_changed` event for each change it was asked
   for (a kill before the first checkpoint would restart from step 0 and test nothing).
The tolerance is float rounding of the changed reduction order (default 1e-4; measured on the
tiny test model: 5e-7). Random numbers drawn in training are not within it: dropout masks are
drawn per rank over its micro-batch, so they depend on the world size; check such a model with
its dropout off (`--set model.args.dropout=0` for the built-in GPT), or pass a wider --tolerance.
A config that cannot pass is refused before anything runs (`refuse_what_cannot_pass`): without
`train.global_batch` a step's batch grows with the world size, and `model.args.dropout` > 0
under the default tolerance (with a --tolerance given, a warning says what it then measures).
Under `parallel.exact_elastic` the default tolerance is 0: B must end bit for bit where A ends
(every loss, every model and optimizer tensor), with dropout on; the verdict then reads
`identical`. Exit code 0 within the tolerance, 1 beyond it, 2 on a user error.
"""

from __future__ import annotations

import math
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.config import RunConfig
from harness.errors import UserError
from harness.log import get_logger
from harness.run.exact_mode import exact_at_every
from harness.verify.resume_equivalence import (
    Popen,
    events_of,
    last_step,
    log_tail,
    start_train,
    step_records,
    wait_for_step,
)

DEFAULT_TOLERANCE = 1e-4
EXACT_TOLERANCE = 0.0  # parallel.exact_elastic: bit for bit
NUMERIC_PARTS = ("model", "optim")  # float tensors whose values depend on the reduction order
# What a change of world size changes on purpose: the random streams, and hashes of exact losses.
_EXPECTED_TO_DIFFER = ("rng", "fingerprints")

log = get_logger(__name__)


def refuse_what_cannot_pass(cfg: RunConfig, sizes: list[int], tolerance: float | None) -> None:
    """UserError, before anything runs, for a config whose check across `sizes` cannot pass: one
    without `train.global_batch` (a step's batch is data.batch_size x grad_accum x world size,
    so no batch of B's matches A's after a change), or with `model.args.dropout` > 0 under the
    default tolerance (`tolerance` None: the masks change with the world size, far beyond float
    rounding); with a tolerance given, dropout only warns. Nothing to refuse without a change;
    under `parallel.exact_elastic` (its masks do not depend on the world size) dropout is fine."""
    if len(set(sizes)) == 1:
        return
    given = f"--world-sizes {','.join(map(str, sizes))}"
    if cfg.train.global_batch is None:
        raise UserError(f"{given}: the config sets no train.global_batch, so a step's batch (data.batch_size x "
                        "train.grad_accum x world size) changes with the world size and B's batches cannot match A's; "
                        f"set it (--set train.global_batch={cfg.data.batch_size * cfg.train.grad_accum * sizes[0]}, "
                        f"the batch at world size {sizes[0]}) to keep the batch at every world size")
    dropout = cfg.model.args.get("dropout")
    if exact_at_every(cfg, sizes) or not (isinstance(dropout, (int, float)) and dropout > 0):
        return
    why = (f"model.args.dropout = {dropout}: dropout masks are drawn per rank over its micro-batch, so they change "
           "with the world size")
    if tolerance is None:
        raise UserError(f"{given}: {why}, and the losses and weights cannot agree within float rounding (the default "
                        f"--tolerance {DEFAULT_TOLERANCE:g}); check with --set model.args.dropout=0, or give a "
                        "--tolerance wide enough for the dropout noise")
    log.warning(f"{why}: the check measures that noise against --tolerance {tolerance:g}")


@dataclass
class WorldVerdict:
    """The outcome of a resume check across world sizes; `bool()` is True when every check passed
    (module docstring). `loss_dev`: max relative loss deviation and its step, over the
    `loss_steps` steps both runs logged, `loss_other_batches` of them on different batches;
    `not_logged`: per run ("A", "B"), the steps of 1..steps it did not log (not comparable);
    `state_dev`: max |diff| per numeric part of the final checkpoints; `unequal`: differences
    that must not exist; `missing_changes`: world-size changes asked for that no
    `world_size_changed` event shows."""

    sizes: list[int]
    steps: int
    tolerance: float
    interrupt_at: list[int]
    batch_step: int | None = None  # the first step whose global batch differs (or is missing in one run)
    loss_dev: float = 0.0
    loss_step: int | None = None
    loss_steps: int = 0
    loss_other_batches: int = 0
    not_logged: dict[str, list[int]] = field(default_factory=dict)
    state_dev: dict[str, float] = field(default_factory=dict)
    unequal: list[str] = field(default_factory=list)
    missing_changes: list[str] = field(default_factory=list)
    story: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return (self.batch_step is None and self.loss_dev <= self.tolerance and not self.unequal
                and not self.missing_changes and all(d <= self.tolerance for d in self.state_dev.values()))

    def __str__(self) -> str:
        sizes = " -> ".join(map(str, self.sizes))
        head = ("identical" if self.tolerance == 0 else "within tolerance") if self else "NOT within tolerance"
        lines = [f"{head}: world size {sizes}, {self.steps} steps, "
                 f"interrupted at {', '.join(map(str, self.interrupt_at))}",
                 f"  tolerance {self.tolerance:g}: per-step loss |A - B| / max(1, |A|), final model/optimizer "
                 f"tensors max |A - B|",
                 "  batches: " + ("identical sample ids at every step" if self.batch_step is None
                                  else f"differ from step {self.batch_step}"),
                 self._loss_line()]
        lines += [f"  state: {part} max |diff| {dev:.3g}" for part, dev in sorted(self.state_dev.items())]
        lines += [f"  must be equal but differs: {line}" for line in self.unequal[:8]]
        lines += [f"  not exercised: {what}" for what in self.missing_changes]
        lines += [f"  B: {line}" for line in self.story]
        return "\n".join(lines)

    def _loss_line(self) -> str:
        line = (f"  loss: max deviation {self.loss_dev:.3g}" + (f" (step {self.loss_step})" if self.loss_step else "")
                + f" over {self.loss_steps} of {self.steps} steps")
        if self.loss_other_batches:
            line += f", {self.loss_other_batches} of them on different batches (which alone changes their loss)"
        unlogged = [f"{len(steps)} not logged by {run} ({_step_list(steps)})"
                    for run, steps in sorted(self.not_logged.items()) if steps]
        return line + ("; not comparable: " + ", ".join(unlogged) if unlogged else "")


def _step_list(steps: list[int], shown: int = 6) -> str:
    text = ", ".join(map(str, steps[:shown]))
    return f"step{'s' if len(steps) > 1 else ''} {text}" + (", ..." if len(steps) > shown else "")


def even_points(steps: int, sizes: list[int]) -> list[int]:
    """One interruption step per world size after the first, evenly spaced over the run."""
    return [max(1, steps * i // len(sizes)) for i in range(1, len(sizes))]


def run_worlds(config: str, steps: int, work: Path, sets: list[str], sizes: list[int], points: list[int],
               sig: signal.Signals, tolerance: float, popen: Popen = subprocess.Popen) -> WorldVerdict:
    """Train `config` in `work`: A continuously at `sizes[0]`, B at `sizes[i]` until it logged
    `points[i]`, interrupted by `sig`, then at the next size; the verdict of `compare_worlds`.
    Every process (a launcher above world size 1) is started by `popen`."""
    runs = {"A": work / "continuous", "B": work / "interrupted"}
    print(f"A: continuous at world size {sizes[0]} in {runs['A']}; B: world size "
          f"{' -> '.join(map(str, sizes))} ({sig.name.removeprefix('SIG')}) in {runs['B']}", flush=True)
    proc_a = start_train(config, runs["A"], sets, work / "continuous.log", world=sizes[0], popen=popen)
    try:
        landed = _elastic(config, runs["B"], sets, work / "interrupted.log", sizes, points, sig, popen)
    except BaseException:
        _kill_tree(proc_a)
        raise
    if proc_a.wait() != 0:
        raise UserError(f"the continuous run failed (exit {proc_a.returncode}); see {work / 'continuous.log'}:\n"
                        + log_tail(work / "continuous.log"))
    return compare_worlds(runs["A"], runs["B"], steps, sizes, landed, tolerance)


def _elastic(config: str, run_dir: Path, sets: list[str], log_path: Path, sizes: list[int], points: list[int],
             sig: signal.Signals, popen: Popen) -> list[int]:
    """Run B segment by segment; returns the step each interruption landed at."""
    landed = []
    for world, point in zip(sizes, points, strict=False):
        starts = len(events_of(run_dir, "start"))
        proc = start_train(config, run_dir, sets, log_path, world=world, popen=popen)
        wait_for_step(proc, run_dir, starts, point, log_path)
        if proc.poll() is None and sig is signal.SIGKILL:
            _kill_tree(proc)
        elif proc.poll() is None:
            proc.send_signal(sig)  # torchrun passes it on to every rank
        proc.wait()
        landed.append(last_step(run_dir))
    proc = start_train(config, run_dir, sets, log_path, world=sizes[-1], popen=popen)
    if proc.wait() != 0:
        raise UserError(f"the resumed run failed at world size {sizes[-1]} (exit {proc.returncode}); see {log_path}:\n"
                        + log_tail(log_path))
    return landed


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once (a lost node)."""
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def compare_worlds(a: Path, b: Path, steps: int, sizes: list[int], points: list[int],
                   tolerance: float) -> WorldVerdict:
    """The verdict for two finished run dirs of `steps` steps (A continuous, B across `sizes`)."""
    from harness.checkpoint.diff import compare_checkpoints
    from harness.checkpoint.store import CheckpointStore

    verdict = WorldVerdict(sizes, steps, tolerance, points)
    by_a = {int(r["step"]): r for r in step_records(a)}
    by_b = {int(r["step"]): r for r in step_records(b)}
    verdict.not_logged = {run: [s for s in range(1, steps + 1) if s not in by]
                          for run, by in (("A", by_a), ("B", by_b))}
    for step in range(1, steps + 1):
        ra, rb = by_a.get(step), by_b.get(step)
        if ra is None or rb is None or ra["batch_hash"] != rb["batch_hash"]:
            verdict.batch_step = verdict.batch_step or step
        if ra is None or rb is None:
            continue
        verdict.loss_steps += 1
        verdict.loss_other_batches += ra["batch_hash"] != rb["batch_hash"]
        dev = abs(ra["loss"] - rb["loss"]) / max(1.0, abs(ra["loss"]))
        if math.isnan(dev) or dev > verdict.loss_dev:
            verdict.loss_dev, verdict.loss_step = (math.inf if math.isnan(dev) else dev), step
    store_a, store_b = CheckpointStore(str(a)), CheckpointStore(str(b))
    final = compare_checkpoints((store_a, store_a.ref(steps)), (store_b, store_b.ref(steps)))
    verdict.state_dev = {part: 0.0 for part in NUMERIC_PARTS}
    for d in final.differences:
        if d.part in NUMERIC_PARTS and d.max_abs is not None:
            verdict.state_dev[d.part] = max(verdict.state_dev[d.part], d.max_abs)
        elif not (d.part in _EXPECTED_TO_DIFFER or d.part.startswith("rank-") or d.where.endswith("loss_digest")):
            verdict.unequal.append(d.line)
    verdict.story, verdict.missing_changes = _changes(b, sizes)
    return verdict


def _changes(run_dir: Path, sizes: list[int]) -> tuple[list[str], list[str]]:
    """(what each of B's processes did, from its events; the asked-for world-size changes that
    did not happen)."""
    story, seen = [], []
    for e in events_of(run_dir, "start", "world_size_changed"):
        if e["event"] == "start":
            story.append("started fresh" if e.get("resumed_from") is None else f"resumed from step {e['resumed_from']}")
        else:
            seen.append((e["old_world_size"], e["new_world_size"]))
            story[-1] += (f", world size {e['old_world_size']} -> {e['new_world_size']} (micro-batch x grad_accum "
                          f"{_shape(e['old'])} -> {_shape(e['new'])})")
    asked = [(old, new) for old, new in zip(sizes, sizes[1:], strict=False) if old != new]
    missing = [f"world size {old} -> {new}: no resume made that change (was a checkpoint committed before "
               f"the interruption?)" for old, new in asked if (old, new) not in seen]
    return story, missing


def _shape(shape: dict | None) -> str:
    return "?" if shape is None else f"{shape['batch_size']} x {shape['grad_accum']}"
