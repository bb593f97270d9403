"""`harness torture RUN_DIR_URL`: crash-consistency torture of the checkpoint store.

For every storage operation N of one save (a lease, a commit, its retention pass, the release)
and every fault mode, start from a run dir holding two committed checkpoints (steps 1 and 2), save
step 3 with the fault at N (storage/faults.py), then check what a restarted run would see:

* lost: discovery must find step 2 or step 3, and step 2 must still verify; once the commit of
  step 3 has returned (the fault hits retention or the lease release), step 3 must survive;
* wrongly accepted: every checkpoint that verifies must load back exactly the state saved for
  its step (a torn file that passed verification would show up here);
* unclean: a new writer must get the lease without --takeover (the old one is released, or its
  pid is dead, or its heartbeat is stale), its next save must succeed and leave no temporary or
  manifest-less folder behind, and it must release the lease;
* a raise mode must surface as an OSError or CheckpointError, never as another exception.

A point that passes all of these is "recovered". The state is tiny (three files of a few hundred
bytes), so a save is about 35 operations on local disk and a point takes milliseconds.

Where the fault runs. `kill` and `powerloss` need a process to die: on local disk the save runs in
a forked child (forked from this process, so no interpreter start or torch import per point) that
SIGKILLs itself at N; `powerloss` first rewinds the disk to what was fsynced (faults.py). The
`memory://` filesystem lives inside one process, so a child's death would take its store with it:
for it (and other object stores) `kill` and `powerloss` become the in-process `crash` mode, which
raises at N and refuses every later operation of the dying store, so no cleanup handler runs and
no open object is closed; nothing is fsynced on an object store, so power loss adds nothing to a
kill there. Raise modes (`eio`, `enospc`, `transient`, `permanent`) run in this process for every
store. Recovery after an in-process fault sees the old lease holder as alive (same pid), so the
checker's clock runs past the lease's staleness limit, as a later restart would.

The corruption sweep (`--corruption`) damages a committed checkpoint file by file (a byte flipped
at many offsets, truncation at several lengths, deletion) and requires every case to be caught by
verification, naming the file, with discovery falling back to the previous checkpoint and
`harness ckpt verify` exiting non-zero.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.checkpoint import CheckpointStore, load
from harness.checkpoint.integrity import verify_target
from harness.checkpoint.lease import LEASE_FILE, MISSED_HEARTBEATS
from harness.checkpoint.manifest import MANIFEST_FILE
from harness.errors import StorageError
from harness.storage.faults import FaultPlan, SimulatedCrash
from harness.storage.location import open_location

DEFAULT_MODES = ("kill", "eio", "enospc", "powerloss")
ALL_MODES = ("kill", "powerloss", "eio", "enospc", "transient", "permanent")
PREV, NEW = 2, 3
KEEP_LAST = 2
LEASE_HEARTBEAT_S = 15.0
LEASE_STALE_S = MISSED_HEARTBEATS * LEASE_HEARTBEAT_S


# `rng` is saved per rank, as the trainer registers it: so the three files are model, rank, state.json.
PER_RANK = frozenset({"rng"})


def tiny_state(step: int) -> dict[str, Any]:
    """A state that differs at every step, in three files (model, rank, state.json)."""
    return {
        "model": {"w": torch.arange(8, dtype=torch.float32) * step, "n": torch.full((3,), step, dtype=torch.int64)},
        "rng": {"seed": torch.tensor([step % 256], dtype=torch.uint8)},
        "trainer": {"step": step, "note": f"saved at step {step}"},
    }


class _Part:
    """A load target shaped like `tiny_state`'s part; keeps what was loaded into it."""

    def __init__(self, template: dict) -> None:
        self.tree = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in template.items()}

    def state_dict(self) -> dict:
        return self.tree

    def load_state_dict(self, tree: dict) -> None:
        self.tree = tree


def loads_as_saved(store: CheckpointStore, ref) -> bool:
    """Whether checkpoint `ref` loads back exactly `tiny_state(ref.step)`."""
    expected = tiny_state(ref.step)
    targets = {name: _Part(tree) for name, tree in expected.items()}
    try:
        load(store, ref, targets)
    except StorageError:
        return False
    for name, tree in expected.items():
        got = targets[name].tree
        if set(got) != set(tree):
            return False
        for key, value in tree.items():
            same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
            if not same:
                return False
    return True


@dataclass
class Point:
    """One fault point's result: `result` is recovered, lost, wrongly accepted or unclean."""

    store: str
    mode: str
    at: int
    op: str
    result: str
    kept_new: bool = False
    detail: str = ""


@dataclass
class Tally:
    tried: int = 0
    recovered: int = 0
    lost: int = 0
    wrongly_accepted: int = 0
    unclean: int = 0
    kept_new: int = 0
    failures: list[Point] = field(default_factory=list)

    def add(self, p: Point) -> None:
        self.tried += 1
        self.kept_new += p.kept_new
        attr = p.result.replace(" ", "_")
        setattr(self, attr, getattr(self, attr) + 1)
        if p.result != "recovered":
            self.failures.append(p)


class Torture:
    """The sweep over one run dir URL (points go to sub-folders, removed after each check)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = dict(storage_options or {})
        self.local = open_location(self.url, self.options).is_local
        self.kind = "local" if self.local else self.url.split("://", 1)[0]

    def _store(self, url: str, writer: str, faults: FaultPlan | None = None,
               clock: Callable[[], float] = time.time) -> CheckpointStore:
        options = {**self.options, **({"faults": faults} if faults else {})}
        return CheckpointStore(url, keep_last=KEEP_LAST, storage_options=options, writer_id=writer,
                               clock=clock, lease_heartbeat_s=LEASE_HEARTBEAT_S)

    def prepare(self, url: str) -> None:
        """A fresh run dir at `url` with steps 1 and 2 committed and no lease."""
        self.remove(url)
        with self._store(url, "torture-setup").lease() as store:
            for step in (1, PREV):
                store.save(step, tiny_state(step), per_rank=PER_RANK)

    def remove(self, url: str) -> None:
        loc = open_location(url, self.options)
        if loc.fs.exists(loc.root):
            loc.fs.rm(loc.root, recursive=True)

    def victim(self, url: str, plan: FaultPlan) -> CheckpointStore:
        """Save step NEW under `plan`, holding the lease; returns the store (for its op trace)."""
        store = self._store(url, "torture-victim", plan)
        with store.lease():
            store.save(NEW, tiny_state(NEW), per_rank=PER_RANK)
        return store

    def operations(self) -> list[tuple[int, str, str]]:
        """(number, operation, path) of every storage operation of the victim's save."""
        url = f"{self.url}/torture-count"
        self.prepare(url)
        trace = self.victim(url, FaultPlan("count")).loc.fs.injector.trace
        self.remove(url)
        return trace

    def point(self, mode: str, at: int, op: str, committed: bool = False) -> Point:
        """Fault `mode` at operation `at`; `committed`: the commit of NEW returned before `at`."""
        url = f"{self.url}/torture-{mode}-{at:04d}"
        self.prepare(url)
        forked = self.local and mode in ("kill", "powerloss")
        plan = FaultPlan(mode if forked or mode not in ("kill", "powerloss") else "crash", at)
        problem = self._run_forked(url, plan) if forked else self._run_here(url, plan)
        clock = time.time if forked else (lambda: time.time() + 2 * LEASE_STALE_S)
        result, kept_new, detail = (("unclean", False, problem) if problem else self.check(url, clock, committed))
        self.remove(url)
        return Point(self.kind, mode, at, op, result, kept_new, detail)

    def _run_forked(self, url: str, plan: FaultPlan) -> str:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                self.victim(url, plan)
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0:
            return ""
        return f"the child exited {os.WEXITSTATUS(status)} instead of dying at operation {plan.at}"

    def _run_here(self, url: str, plan: FaultPlan) -> str:
        try:
            self.victim(url, plan)
        except (SimulatedCrash, OSError, StorageError):
            pass
        except Exception as e:  # an injected fault must never turn into another kind of error
            return f"{type(e).__name__}: {e}"
        return ""

    def check(self, url: str, clock: Callable[[], float], committed: bool = False) -> tuple[str, bool, str]:
        """(result, whether step NEW survived, detail) for the run dir a fault left behind."""
        store = self._store(url, "torture-resume", clock=clock)
        good = store.latest_good()
        accepted = [r for r in store.list() if not store.verify(r)]
        wrong = [r.step for r in accepted if not loads_as_saved(store, r)]
        if wrong:
            return "wrongly accepted", False, f"steps {wrong} verify but do not hold what was saved"
        if good is None or good.step not in (PREV, NEW) or PREV not in {r.step for r in accepted}:
            return "lost", False, f"discovery found {good and good.step}, verified steps {[r.step for r in accepted]}"
        kept_new = good.step == NEW
        if committed and not kept_new:
            return "lost", False, f"step {NEW} was committed before the fault and is gone"
        try:
            store.acquire_lease()
            store.save(good.step + 1, tiny_state(good.step + 1), per_rank=PER_RANK)
        except StorageError as e:
            return "unclean", kept_new, f"restart could not save: {e}"
        leftovers = store.incomplete()
        store.release_lease()
        if leftovers:
            return "unclean", kept_new, f"left behind after the next save: {leftovers}"
        if store.loc.fs.exists(store.loc.join(LEASE_FILE)):
            return "unclean", kept_new, "the lease file is still there after release"
        newest = store.latest_good()
        if newest is None or newest.step != good.step + 1:
            return "lost", kept_new, f"the save after the restart is not the newest good checkpoint ({newest})"
        return "recovered", kept_new, ""

    def sweep(self, modes: Iterable[str], points: int | None = None,
              progress: Callable[[Point], None] | None = None) -> dict[str, Tally]:
        """Every (or `points` evenly spaced) operation number of the save, for each mode."""
        trace = self.operations()
        committed_at = commit_returned_at(trace)
        chosen = trace if points is None or points >= len(trace) else \
            [trace[round(i * (len(trace) - 1) / max(points - 1, 1))] for i in range(points)]
        tallies: dict[str, Tally] = {}
        for mode in modes:
            tally = tallies.setdefault(mode, Tally())
            for at, op, _ in chosen:
                p = self.point(mode, at, op, committed=at >= committed_at)
                tally.add(p)
                if progress:
                    progress(p)
        return tallies


def commit_returned_at(trace: list[tuple[int, str, str]]) -> int:
    """The first operation after `commit(NEW)` returned: retention's listing after the last
    operation on NEW's manifest (its rename and folder fsync on local disk)."""
    name = f"step-{NEW:08d}"
    last = max(n for n, _, path in trace if name in path and (MANIFEST_FILE in path or "->" in path))
    return next(n for n, op, _ in trace if n > last and op == "list")


# ---- corruption sweep ------------------------------------------------------------------------

@dataclass
class CorruptionResult:
    cases: int = 0
    detected: int = 0
    named: int = 0
    fell_back: int = 0
    cli_failed: int = 0
    misses: list[str] = field(default_factory=list)


def _damages(name: str, size: int, offsets: int) -> list[tuple[str, int]]:
    flips = sorted({min(size - 1, round(i * (size - 1) / max(offsets - 1, 1))) for i in range(offsets)}) if size else []
    cuts = sorted({0, 1, size // 2, size - 1} - {size} if size else set())
    return [("flip", o) for o in flips] + [("truncate", n) for n in cuts] + [("delete", 0)]


def corruption_sweep(torture: Torture, offsets: int = 16, cli: bool = True) -> CorruptionResult:
    """Damage every file of committed step PREV in turn; see the module docstring."""
    url = f"{torture.url}/torture-corrupt"
    torture.prepare(url)
    store = torture._store(url, "torture-verify")
    ref = store.ref(PREV)
    fs = store.loc.fs
    names = [r.name for r in store.manifest(ref).files] + [MANIFEST_FILE]
    out = CorruptionResult()
    for name in names:
        path = f"{ref.path}/{name}"
        original = fs.cat_file(path)
        for kind, arg in _damages(name, len(original), offsets):
            if kind == "flip":
                damaged = original[:arg] + bytes([original[arg] ^ 0xFF]) + original[arg + 1:]
                fs.pipe_file(path, damaged)
            elif kind == "truncate":
                fs.pipe_file(path, original[:arg])
            else:
                fs.rm(path)
            problems = store.verify(ref)
            good = store.latest_good()
            out.cases += 1
            out.detected += bool(problems)
            out.named += any(name in p for p in problems)
            out.fell_back += good is not None and good.step == 1
            if cli:
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    code = verify_target(ref.url, torture.options or None)
                out.cli_failed += code != 0 and name in text.getvalue()
            if not (problems and any(name in p for p in problems) and good is not None and good.step == 1):
                out.misses.append(f"{kind} {name} at {arg}: problems={problems} discovery={good}")
            fs.pipe_file(path, original)
    torture.remove(url)
    return out


# ---- report ----------------------------------------------------------------------------------

def format_table(kind: str, tallies: dict[str, Tally]) -> str:
    head = (f"{'store':8} {'mode':10} {'points':>6} {'recovered':>9} {'lost':>5} {'wrongly accepted':>16} "
            f"{'unclean':>7} {'new kept':>8}")
    rows = [head]
    for mode, t in tallies.items():
        rows.append(f"{kind:8} {mode:10} {t.tried:>6} {t.recovered:>9} {t.lost:>5} {t.wrongly_accepted:>16} "
                    f"{t.unclean:>7} {t.kept_new:>8}")
    total = Tally()
    for t in tallies.values():
        for attr in ("tried", "recovered", "lost", "wrongly_accepted", "unclean", "kept_new"):
            setattr(total, attr, getattr(total, attr) + getattr(t, attr))
    rows.append(f"{kind:8} {'all':10} {total.tried:>6} {total.recovered:>9} {total.lost:>5} "
                f"{total.wrongly_accepted:>16} {total.unclean:>7} {total.kept_new:>8}")
    return "\n".join(rows)
