"""`harness verify-resume CONFIG`: check that interrupting and resuming a run changes nothing.

The runner trains the config twice in a scratch folder, each in real `harness train` processes,
one run after the other: A continuously, B with interruptions (SIGKILL or SIGTERM sent once B's
metrics show the chosen step, then the same command again, which resumes). Both record a
fingerprint every step (loss, batch hash, and with `--fingerprint-every 1` the hash of every
state part; see `harness.repro.fingerprint`), with `train.on_divergence = "warn"` so B runs to the end
either way.
Then it compares:
1. the per-step fingerprints of A and B (B's metrics.jsonl reads like an uninterrupted run's);
2. the `resume_mismatch` events B's resumed processes raised (a restored part that hashes
   differently from the saved one is caught there, at the checkpoint's step), and their
   `unsaved_buffers` events (non-persistent buffers that carry state, which then take the blame);
3. the final checkpoints, tensor by tensor (`harness.checkpoint.diff`).
The verdict is "identical", or the first divergent step with the part to blame (`diagnose`), the
tensor and its max |difference| in the final checkpoints, and a hint. Exit code 0 only when
identical, 1 when not, 2 on a user error (including a run that fails on its own).

`Verdict` is shared with the in-process helper `harness.testing.check_resume`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UserError
from harness.records.events import EVENTS_FILE
from harness.records.jsonlines import records
from harness.records.run_files import METRICS_FILE
from harness.repro.fingerprint import FIELDS, diagnose, differing_fields, ordered_parts

START_TIMEOUT_S = 600.0
Popen = Callable[..., subprocess.Popen]  # subprocess.Popen, or a fork server's (same arguments)


@dataclass
class Verdict:
    """The outcome of a resume check. `bool(verdict)` is True only when identical.

    When not identical: `step` is the first divergent step, `when` is "step" (a re-run step
    differs) or "restore" (the state right after loading differs from the saved one, at the
    checkpoint's step) or "final" (only the final checkpoints differ); `part` the state part to
    blame, `tensor` and `max_diff` the tensor of that part that differs (with its largest
    absolute element difference) where one is known, `hint` the likely cause."""

    identical: bool
    steps: int
    interrupt_at: list[int]  # the steps the interrupted run had reached when each interruption landed
    planned: list[int] | None = None  # the steps asked for, when they differ from where the kills landed
    step: int | None = None
    when: str = "step"
    fields: list[str] = field(default_factory=list)
    part: str | None = None
    tensor: str | None = None
    max_diff: float | None = None
    hint: str = ""
    details: list[str] = field(default_factory=list)
    # B's restarts that resumed from no checkpoint (the interruption came before the first one
    # committed: nothing was tested, as a missing world-size change in verify/world_equivalence.py)
    not_resumed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.identical and not self.not_resumed

    def headline(self) -> str:
        if self.identical and self.not_resumed:
            return (f"not exercised: B restarted from nothing after the interruption at step(s) "
                    f"{', '.join(map(str, self.not_resumed))} (was a checkpoint committed before it?); no resume was "
                    f"tested")
        if self.identical:
            planned = f" (planned {', '.join(map(str, self.planned))})" if self.planned else ""
            return (f"identical: {self.steps} steps, interrupted at {', '.join(map(str, self.interrupt_at)) or '-'}"
                    f"{planned}; loss, batch and state fingerprints match at every step and the final checkpoints "
                    f"are equal")
        where = {"restore": f"step {self.step} (right after restoring)", "final": "the final checkpoint"}.get(
            self.when, f"step {self.step}")
        text = f"diverged at {where}: part {self.part}"
        if self.tensor:
            text += f", tensor {self.tensor}"
        if self.max_diff is not None:
            text += f", max |diff| {self.max_diff:.6g}"
        return f"{text}; hint: {self.hint}"

    def __str__(self) -> str:
        return "\n".join([self.headline(), *(f"  {line}" for line in self.details)])


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, list[str]] | None:
    """(step, differing fields) of the first step whose records differ or exist in one run only."""
    by_a, by_b = {int(r["step"]): r for r in a}, {int(r["step"]): r for r in b}
    for step in sorted(by_a.keys() | by_b.keys()):
        if step not in by_a or step not in by_b:
            return step, [f"missing in {'A' if step not in by_a else 'B'}"]
        fields = differing_fields(by_a[step], by_b[step])
        if fields:
            return step, fields
    return None


def blame(diffs: list, part: str | None, prefer: str | None = None) -> tuple[str | None, float | None]:
    """(tensor or JSON path, max |diff|) among checkpoint differences of `part` (of any part when
    it has none): the one named `prefer` when present, else the largest tensor difference, else
    the first difference."""
    # A part that is not saved (an unregistered scheduler, the RNG) has no differences of its
    # own: then the tensor where its effect is largest is named.
    mine = [d for d in diffs if d.part == part] or diffs
    if not mine:
        return None, None
    for d in mine:
        if prefer and d.where.endswith(prefer):
            return d.where, d.max_abs
    tensors = [d for d in mine if d.max_abs is not None]
    best = max(tensors, key=lambda d: d.max_abs) if tensors else mine[0]
    return best.where, best.max_abs


def describe_fields(step: int, fields: list[str], a: dict | None, b: dict | None) -> list[str]:
    """Lines that show what differs in two records of one step."""
    lines = [f"at step {step}: {', '.join(fields)} differ (A = continuous, B = interrupted)"]
    for key, name in (("loss", "loss"), ("lr", "lr"), ("batch", "batch_hash")):
        if key in fields and a and b:
            lines.append(f"{name}: A={json.dumps(a.get(name))} B={json.dumps(b.get(name))}")
    return lines


# ---- the two runs ----------------------------------------------------------------------------


def run_pair(config: str, steps: int, work: Path, sets: list[str], points: list[int],
             sig: signal.Signals, popen: Popen = subprocess.Popen) -> Verdict:
    """Train `config` (`steps` steps, with `--set` items `sets`) in `work`: A continuously, B interrupted by
    `sig` once it logged each step of `points`; then the verdict of `compare_runs`. Each run's
    output goes to `work/continuous.log` and `work/interrupted.log`; a run that fails on its
    own is a UserError (with the tail of its log). `popen` starts each `harness` process (the
    CLI passes a fork server's where it can: harness/forkserver/pool.py)."""
    runs = {"A": work / "continuous", "B": work / "interrupted"}
    for path in runs.values():
        if path.exists():
            shutil.rmtree(path)
    print(f"A: continuous in {runs['A']}; B: interrupted ({sig.name.removeprefix('SIG')}) in {runs['B']}", flush=True)
    # One run after the other, never side by side: each trains on torch's default thread count
    # (as the user's run does), and two such runs on the same cores spend most of their CPU time
    # in OpenMP threads spinning at barriers while their partner is off the core.
    proc_a = start_train(config, runs["A"], sets, work / "continuous.log", popen=popen)
    try:
        code_a = proc_a.wait()
    except BaseException:
        proc_a.kill()
        raise
    if code_a != 0:
        raise UserError(f"the continuous run failed (exit {code_a}); see {work / 'continuous.log'}:\n"
                        + log_tail(work / "continuous.log"))
    story, landed = _interrupted(config, runs["B"], sets, work / "interrupted.log", points, sig, popen)
    print("B: " + "; ".join(story), flush=True)
    verdict = compare_runs(runs["A"], runs["B"], steps, landed)
    if landed != points:
        verdict.planned = points
    return verdict


def start_train(config: str, run_dir: Path, sets: list[str], log_path: Path, world: int = 1,
                popen: Popen = subprocess.Popen) -> subprocess.Popen:
    """`harness train` with its logs in the run dir: one process, or `world` under torchrun
    (standalone rendezvous, so several groups can run side by side), started by `popen`."""
    launcher = [sys.executable, "-m", "harness.cli"]
    if world > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    "--max-restarts", "0", "-m", "harness.cli"]
    cmd = [*launcher, "--log-level", "warning", "train", config, "--run-dir", str(run_dir),
           "--set", f'log_dir="{run_dir}"', *[x for s in sets for x in ("--set", s)]]
    with log_path.open("a") as log_file:
        return popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)


def _interrupted(config: str, run_dir: Path, sets: list[str], log_path: Path, points: list[int],
                 sig: signal.Signals, popen: Popen) -> tuple[list[str], list[int]]:
    """Run B: start, signal at each point, restart; finally run to the end. Returns what happened
    and the step each interruption landed at (the last step the process logged: it keeps
    training between the point being logged and the signal arriving)."""
    story, landed = [], []
    for point in points:
        starts = len(events_of(run_dir, "start"))
        proc = start_train(config, run_dir, sets, log_path, popen=popen)
        resumed = wait_for_step(proc, run_dir, starts, point, log_path)
        if proc.poll() is None:
            proc.send_signal(sig)
        code = proc.wait()
        landed.append(last_step(run_dir))
        story.append(f"{resumed} -> {sig.name} landed at step {landed[-1]} (planned {point}, exit {code})")
    starts = len(events_of(run_dir, "start"))
    proc = start_train(config, run_dir, sets, log_path, popen=popen)
    code = proc.wait()
    begun = events_of(run_dir, "start")[starts:]
    story.append(f"resumed from {begun[0].get('resumed_from') if begun else '?'} -> finished (exit {code})")
    if code != 0:
        raise UserError(f"the interrupted run failed after its last restart (exit {code}); see {log_path}:\n"
                        + log_tail(log_path))
    return story, landed


def wait_for_step(proc: subprocess.Popen, run_dir: Path, starts: int, point: int, log_path: Path) -> str:
    """Wait until this process started (its start event) and logged step `point`."""
    deadline = time.monotonic() + START_TIMEOUT_S
    begun: list[dict] = []
    while proc.poll() is None and time.monotonic() < deadline:
        begun = events_of(run_dir, "start")[starts:]
        if begun and last_step(run_dir) >= point:
            break
        time.sleep(0.02)
    if proc.poll() not in (None, 0):
        raise UserError(f"the interrupted run failed before step {point} (exit {proc.returncode}); see "
                        f"{log_path}:\n" + log_tail(log_path))
    start = begun[0].get("resumed_from") if begun else None
    return "started fresh" if start is None else f"resumed from {start}"


def _read(path: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of a log so far ([] before it exists); a line being written is skipped."""
    return list(records(path)) if path.exists() else []


def events_of(run_dir: Path, *kinds: str) -> list[dict]:
    """The run's events of these kinds so far, in order."""
    return [e for e in _read(run_dir / EVENTS_FILE) if e.get("event") in kinds]


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: r[k] for k in FIELDS if k in r} for r in _read(run_dir / METRICS_FILE) if "batch_hash" in r]


def last_step(run_dir: Path) -> int:
    return max((int(r.get("step", 0)) for r in _read(run_dir / METRICS_FILE)), default=0)


def log_tail(path: Path, n: int = 3000) -> str:
    return path.read_text()[-n:] if path.exists() else ""


def compare_runs(a: Path, b: Path, steps: int, points: list[int]) -> Verdict:
    """The verdict for two finished run dirs of `steps` steps (A continuous, B interrupted)."""
    from harness.checkpoint.diff import compare_checkpoints
    from harness.checkpoint.store import CheckpointStore

    rec_a, rec_b = step_records(a), step_records(b)
    found = first_divergence(rec_a, rec_b)
    store_a, store_b = CheckpointStore(str(a)), CheckpointStore(str(b))
    final = compare_checkpoints((store_a, store_a.ref(steps)), (store_b, store_b.ref(steps)))
    noticed = events_of(b, "resume_mismatch")
    restored = [e for e in noticed if any(f.startswith("restored:") for f in e["fields"])]
    verdict = Verdict(identical=False, steps=steps, interrupt_at=points)
    restarts = events_of(b, "start")[1:]
    verdict.not_resumed = [p for p, e in zip(points, restarts, strict=False) if e.get("resumed_from") is None]
    verdict.details += [f"B's resumed process reported at step {e['step']}: {', '.join(e['fields'])}" for e in noticed]
    if restored and (found is None or restored[0]["step"] < found[0]):
        verdict.step, verdict.when, verdict.fields = restored[0]["step"], "restore", restored[0]["fields"]
    elif found is not None:
        verdict.step, verdict.fields = found
        by_a, by_b = {r["step"]: r for r in rec_a}, {r["step"]: r for r in rec_b}
        verdict.details += describe_fields(found[0], found[1], by_a.get(found[0]), by_b.get(found[0]))
    elif not final.equal:
        verdict.when = "final"
        verdict.fields = [f"state:{p}" for p in ordered_parts({d.part for d in final.differences})]
    else:
        verdict.identical = True
        return verdict
    unsaved = sorted({b for e in events_of(b, "unsaved_buffers") for b in e["buffers"]})
    verdict.fields += [f"unsaved:{name}" for name in unsaved]
    verdict.part, verdict.hint = diagnose(verdict.fields)
    if verdict.when == "final":
        verdict.hint = ("every step's fingerprint matches, only the final checkpoints differ: state that does not "
                        "take part in the steps (a counter, a buffer) is not restored")
    verdict.tensor, verdict.max_diff = blame(final.differences, verdict.part)
    if unsaved:  # not in any checkpoint, so no difference there names it
        verdict.tensor, verdict.max_diff = unsaved[0], None
    if final.differences:
        verdict.details.append("final checkpoints differ (first differences):")
        verdict.details += [f"  {d.line}" for d in final.differences[:8]]
    return verdict
