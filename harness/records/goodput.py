"""Goodput: where a run's wall-clock time went, computed from its events file alone.

Event schema (every line also has "time": unix seconds, "event": the kind, "pid"). Emitted by
the trainer (rank 0 only) unless marked supervisor:

| event      | fields                                   | when |
|------------|------------------------------------------|------|
| start      | resumed_from: int or null,               | once per process, after the state is restored and checked,   |
|            | resumed_tier: "local", "peer",           | just before the first step; resumed_tier = the checkpoint    |
|            | "persistent" or null,                    | tier resumed from (checkpoint/save/local_tier.py; "peer": a  |
|            |                                          | rank's part came from a peer copy, peer_copies.py);          |
|            | previous_reached: int or null,           |                                                              |
|            | startup_s, build_s, restore_s,           | previous_reached = the last step the interrupted process     |
|            | rss_bytes, total_steps                   |                                                              |
|            |                                          | logged to                                                    |
|            |                                          | metrics.jsonl (every step is logged there), null when it     |
|            |                                          | logged none past                                             |
|            |                                          | resumed_from; startup_s = seconds since the process started  |
|            |                                          | (imports, config, restore); restore_s = the part spent       |
|            |                                          | finding, verifying, loading and checking the checkpoint;     |
|            |                                          | build_s = building the trainer (model, optimizer), not in    |
|            |                                          | restore_s; rss_bytes = resident memory then                  |
| progress   | step, train_s                            | every few steps (e.g. each console log line) and after each  |
|            |                                          | checkpoint; step = steps completed so far; train_s = seconds |
|            |                                          | this process has spent inside training steps so far          |
|            |                                          | (cumulative, blocking saves excluded)                        |
| checkpoint | step, blocking_s                         | after each commit; blocking_s = seconds the step loop was    |
|            |                                          | blocked by this save                                         |
| local_checkpoint | step, blocking_s, bytes,           | after each save to the local tier (blocking_s: with the wait |
|            | background                               | for the previous one and its peer exchange; counted as       |
|            |                                          | saving); committed then unless `background`                  |
| local_committed | step, persist_s, bytes              | a background local save committed (from its thread)          |
| checkpoint_rejected | tier, step, url, problem        | a local checkpoint or peer copy (tier "peer", with owner)    |
|            | (rank, owner)                            | passed over at a resume (damaged, another run's); before     |
|            |                                          | that process's start                                         |
| save_slow  | step, seconds                            | while a background save has been persisting longer than      |
|            |                                          | expected (checkpoint.save_deadline_s), repeated each slow    |
|            |                                          | interval                                                     |
| exit       | reason, step, train_s, exit_code, error  | when the process ends by itself: "finished" (0), "preempted" |
|            |                                          | (75), "save_deadline_missed" (76, from the deadline          |
|            |                                          | watchdog), "user_error" (2) or "crashed" (an exception;      |
|            |                                          | error = its type and message); train_s as in progress. A     |
|            |                                          | process that is killed writes none                           |
| restart    | cause, exit_code, step, restart,         | supervisor, before each restart; step = newest committed     |
|            | backoff_s                                | checkpoint                                                   |
| anomaly    | action, step, batch, cause, value,       | an anomaly (harness/health/anomaly.py) at `step` (not        |
|            | to_step, skip, error                     | applied): action "rollback" (back to checkpoint `to_step`,   |
|            |                                          | step-batches `skip` skipped) or "stop" (error = the message) |
| hang       | phase, step, limit_s, waited_s, stacks,  | the hang watchdog fired (harness/health/watchdog.py),        |
|            | nccl_trace                               | followed by exit reason "hung" (79)                          |
| gave_up    | cause, step, restarts, streak, stderr_tail | supervisor, when it stops retrying |

Accounting (`account(events)`), with one "process" = the events from one "start" to the next:

- training: the last train_s of each process, summed, minus recomputing (productive time only).
- saving: the sum of blocking_s of both tiers (background persistence that overlaps training is free).
- restarting: the backoff_s of every restart plus the startup_s of every process but the first.
- recomputing: steps run twice. When process P is followed by Q, the steps from Q's
  resumed_from (0 if null) up to the last step P is known to have reached (progress,
  checkpoint or exit events, and Q's previous_reached, read from every step P logged) were
  lost and re-run; so were the steps from a rollback's `to_step` to its anomaly's step. They
  are costed at the run's mean step time (training time / steps it covered).
- other: wall clock minus the above (evaluation, logging, data stalls, time between a crash and
  the next start that no supervisor accounted for, queueing of a requeued job).
- wall clock: from the first process's start (its start time minus startup_s) to the last event.
- resumes: one record per process after the first: the step and tier it resumed from, the steps
  it lost (the previous process's last step minus that step) and its restore_s.
- without the local tier (`goodput_without_local`, None for a run that never saved to it): the
  same run had every resume from the local or peer tier gone to the newest persistent checkpoint
  committed before it instead (more steps re-run, at the mean step time), and no local save
  blocked the loop. Restore and startup times are taken as they were: on a shared file system or
  S3 a persistent restore is slower, so the figure is an upper bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _Process:
    resumed_from: int | None
    startup_s: float = 0.0
    tier: str | None = None
    restore_s: float = 0.0
    train_s: float = 0.0
    train_s_step: int | None = None  # the step at which train_s was last reported
    last_step: int | None = None
    newest_persistent: int | None = None  # the newest persistent checkpoint committed before its start

    @property
    def first_step(self) -> int:
        return self.resumed_from or 0

    def reached(self, step: int) -> None:
        self.last_step = step if self.last_step is None else max(self.last_step, step)


@dataclass
class Goodput:
    """Seconds per category (see the module docstring) and a few counts."""

    wall_s: float = 0.0
    training_s: float = 0.0
    saving_s: float = 0.0
    local_saving_s: float = 0.0  # the part of saving_s spent on the local tier
    restarting_s: float = 0.0
    recompute_s: float = 0.0
    recompute_steps: int = 0
    processes: int = 0
    restarts: int = 0
    last_step: int | None = None
    exit_reason: str | None = None  # of the last process: an "exit" reason, "gave_up" or None
    rollbacks: list[dict] = field(default_factory=list)  # distinct "anomaly" events with action "rollback"
    resumes: list[dict] = field(default_factory=list)  # step, tier, steps_lost, restore_s per later process
    extra_steps_without_local: int = 0  # steps the local and peer resumes saved over the persistent tier
    mean_step_s: float = 0.0

    @property
    def other_s(self) -> float:
        return self.wall_s - self.training_s - self.saving_s - self.restarting_s - self.recompute_s

    @property
    def goodput(self) -> float:
        """Productive training time as a fraction of wall clock (0 for an empty run)."""
        return self.training_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def goodput_without_local(self) -> float | None:
        """The goodput the run would have had without the local tier (module docstring); None
        when it never saved to that tier."""
        if self.local_saving_s <= 0 and not self.extra_steps_without_local:
            return None
        wall = self.wall_s - self.local_saving_s + self.extra_steps_without_local * self.mean_step_s
        return self.training_s / wall if wall > 0 else 0.0


# The trainer's events that tell how far its process got (each has a step).
_REACHED = ("progress", "checkpoint", "local_checkpoint", "exit")


@dataclass
class _Run:
    """The events folded so far: the processes in order, the clock's ends, and the running
    figures `totals` needs besides the per-process ones."""

    g: Goodput = field(default_factory=Goodput)
    procs: list[_Process] = field(default_factory=list)
    # When the run began: the first process's start (its start time minus startup_s), or the time of
    # an event before any start.
    first_time: float | None = None
    last_time: float | None = None  # of the last event of any kind
    rolled_back: int = 0  # steps computed again after rollbacks
    persistent: int | None = None  # the newest persistent checkpoint committed so far

    def add(self, e: dict) -> None:
        """Fold in the next event."""
        kind, t = e.get("event"), float(e.get("time", 0.0))
        self.last_time = t
        if kind == "start":
            self._start(e, t)
            return
        if self.first_time is None:
            self.first_time = t
        if kind == "restart":
            self.g.restarts += 1
            self.g.restarting_s += float(e.get("backoff_s", 0.0))
        elif kind == "gave_up":
            self.g.exit_reason = "gave_up"
        elif kind == "anomaly" and e.get("action") == "rollback":
            self._rollback(e)
        elif kind in _REACHED:
            self._reached(kind, e)

    def _start(self, e: dict, t: float) -> None:
        """A new process: the previous one reached the step it says it logged last."""
        if self.procs and isinstance(e.get("previous_reached"), int):
            self.procs[-1].reached(e["previous_reached"])
        self.procs.append(_Process(e.get("resumed_from"), float(e.get("startup_s", 0.0)), e.get("resumed_tier"),
                                   float(e.get("restore_s", 0.0)), newest_persistent=self.persistent))
        self.g.exit_reason = None
        if self.first_time is None:
            self.first_time = t - self.procs[-1].startup_s

    def _rollback(self, e: dict) -> None:
        """A rollback's steps are run again, each time it happens; it is listed once."""
        # A run resumed from before a rollback meets the same anomaly again: the same rollback.
        seen = {(r["step"], r["batch"], r["to_step"]) for r in self.g.rollbacks}
        if (e["step"], e["batch"], e["to_step"]) not in seen:
            self.g.rollbacks.append(e)
        self.rolled_back += max(0, int(e["step"]) - int(e["to_step"]))

    def _reached(self, kind: str, e: dict) -> None:
        """A trainer event of `_REACHED`: the current process got to its step; saves block, an
        exit ends it, progress and exit carry its training seconds so far."""
        if not self.procs:  # trainer events before any "start": a process that never announced itself
            self.procs.append(_Process(None))
        p = self.procs[-1]
        p.reached(int(e["step"]))
        if kind in ("checkpoint", "local_checkpoint"):
            self.g.saving_s += float(e.get("blocking_s", 0.0))
        if kind == "local_checkpoint":
            self.g.local_saving_s += float(e.get("blocking_s", 0.0))
        if kind == "checkpoint":
            self.persistent = int(e["step"]) if self.persistent is None else max(self.persistent, int(e["step"]))
        if kind == "exit":
            self.g.exit_reason = e.get("reason")
        if kind in ("progress", "exit") and "train_s" in e:
            p.train_s, p.train_s_step = float(e["train_s"]), int(e["step"])

    def totals(self) -> Goodput:
        """The `Goodput` of the run, once its last event is folded in (module docstring: the
        accounting). Called once: it adds the per-process figures to the running ones."""
        g, procs = self.g, self.procs
        g.processes = len(procs)
        # `add` sets last_time with first_time (any event): both or neither.
        g.wall_s = 0.0 if self.first_time is None or self.last_time is None else self.last_time - self.first_time
        g.restarting_s += sum(p.startup_s for p in procs[1:])
        g.last_step = max((p.last_step for p in procs if p.last_step is not None), default=None)

        total_train = sum(p.train_s for p in procs)
        covered = sum(max(0, p.train_s_step - p.first_step)
                      for p in procs if p.train_s_step is not None)
        covered += self.rolled_back
        mean_step_s = g.mean_step_s = total_train / covered if covered else 0.0
        successions = list(zip(procs, procs[1:], strict=False))  # (a process, the one after it)
        g.recompute_steps = self.rolled_back + sum(max(0, (prev.last_step or 0) - nxt.first_step)
                                                   for prev, nxt in successions)
        g.recompute_s = g.recompute_steps * mean_step_s
        g.resumes = [{"step": nxt.resumed_from, "tier": nxt.tier, "restore_s": nxt.restore_s,
                      "steps_lost": max(0, (prev.last_step or 0) - nxt.first_step)} for prev, nxt in successions]
        g.extra_steps_without_local = sum(max(0, nxt.first_step - (nxt.newest_persistent or 0))
                                          for nxt in procs[1:] if nxt.tier not in (None, "persistent"))
        g.training_s = total_train - g.recompute_s
        return g


def account(events: Iterable[dict]) -> Goodput:
    """Fold a run's events (in file order) into a `Goodput`; unknown kinds are ignored."""
    run = _Run()
    for e in events:
        run.add(e)
    return run.totals()


def describe_resumes(resumes: list[dict]) -> str:
    """"step 6 from the local tier, 1 step lost, restored in 0.03 s; ..." (a fresh start: "step 0")."""
    def one(r: dict) -> str:
        where = f" from the {r['tier']} tier" if r["tier"] else ""
        lost = r["steps_lost"]
        return f"step {r['step'] or 0}{where}, {lost} step{'s' if lost != 1 else ''} lost, restored in " \
               f"{r['restore_s']:.2f} s"

    return "; ".join(one(r) for r in resumes)

