"""The step loop around the trainer (`Loop`): metrics, evaluation, checkpoints at the cadence
`CheckpointClock` decides (synchronously, in the background, local-first) and to the local tier at
its own cadence (checkpoint/save/local_tier.py), preemption within its
deadline, the fault hooks of `[debug]` (harness/health/debug_hooks.py), and the health hooks
(harness/health: the hang watchdog, rollback on an anomaly, the trackers)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness import exit_codes
from harness.checkpoint import (
    LOCAL,
    PERSISTENT,
    CheckpointStore,
    Committed,
    LocalTier,
    SaveHooks,
    SaveSettings,
    open_saver,
)
from harness.config import RunConfig, public_config
from harness.health.debug_hooks import DebugHooks
from harness.health.watchdog import HangReport, HangWatchdog
from harness.log import get_logger
from harness.models.hf import HF_CONFIG_META
from harness.parallel import distributed
from harness.parallel.distributed import Silent
from harness.process.signals import PreemptionWatch, SaveDeadline
from harness.records.events import EventLog
from harness.records.metrics import MetricsLog
from harness.repro.fingerprint import fingerprint_fields
from harness.run.cadence import CheckpointClock
from harness.run.environment import environment_fingerprint
from harness.run.rollback import roll_back
from harness.run.trainer import StepResult, Trainer, TrainingDiverged

log = get_logger(__name__)


class Loop:
    """The outer loop: steps, metrics, evaluation, checkpoint cadence, preemption, fault hooks, and
    the health hooks (harness/health): the hang watchdog around every blocking phase (`watch`),
    rollback on an anomaly (`anomaly`), the trackers next to metrics.jsonl."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, store: CheckpointStore, metrics: MetricsLog | Silent,
                 events: EventLog | Silent, log_dir: Path, last_committed: int | None = None, trackers: Any = None,
                 local_tier: LocalTier | None = None, replicate: bool = False) -> None:
        """`replicate`: save the resumed state to the local tier before the first step (every rank
        at once, with its peer copy): after a resume from copies at another world size or from a
        peer, the copies the lost ranks held for others exist once until then."""
        self.cfg, self.trainer, self.store, self.metrics, self.events = cfg, trainer, store, metrics, events
        self.trackers = trackers if trackers is not None else distributed.Silent()
        self.log_dir = log_dir
        self.local_tier = local_tier
        self.replicate = replicate
        c = cfg.checkpoint
        self.clock = CheckpointClock(c.every_steps, c.every_minutes, cfg.train.steps, mtbf_s=c.mtbf_hours * 3600.0,
                                     report=self.interval_chosen)
        # One clock per tier: the local tier's "auto" is Young/Daly from its own (cheaper) saves.
        self.local_clock: CheckpointClock | None = None
        if local_tier is not None:
            assert c.local is not None  # session.py opens a local tier for [checkpoint.local]
            self.local_clock = CheckpointClock(
                c.local.every_steps, 0.0, cfg.train.steps, mtbf_s=c.mtbf_hours * 3600.0,
                report=functools.partial(self.interval_chosen, tier=LOCAL))
        # Every save goes through this one saver (sync or async; group, local-first or direct).
        settings = SaveSettings(background=c.async_save, local_dir=c.local_dir, when_busy=c.when_busy,
                                save_deadline_s=c.save_deadline_s,
                                staging_bytes=None if c.staging_mib is None else c.staging_mib << 20,
                                persist_delay_s=cfg.debug.persist_delay_s, fail_rank=cfg.debug.fail_save_rank,
                                fail_step=cfg.debug.fail_save_step)
        self.saver = open_saver(store, settings, per_rank=trainer.state.per_rank, sharded=trainer.state.sharded,
                                hooks=SaveHooks(on_commit=self.committed, on_slow=self.slow_save),
                                last_committed=last_committed)
        if local_tier is not None:  # in the background when the run dir's saves are, through the same staging memory
            local_tier.save_like(self.saver, on_commit=self.local_committed)
        self.staging_ready = False
        self.last_saved = trainer.step
        self.train_s = 0.0
        self.save_s = 0.0
        h = cfg.health
        self.watchdog = HangWatchdog(log_dir, factor=h.hang_factor, floor_s=h.hang_floor_s, first_step_s=h.first_step_s,
                                     rank=distributed.rank(), on_hang=self.hung) if h.hang_watchdog else None
        self.debug = DebugHooks(cfg.debug, log_dir, distributed.rank(), trainer.stream)

    def watch(self, phase: str, **limits: float) -> contextlib.AbstractContextManager:
        """The hang watchdog's deadline around one blocking phase of the next step (or nothing)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watch(phase, self.trainer.step + 1, **limits)

    def save_limits(self) -> dict[str, float]:
        """A background save has its own deadline (exit 69, clearer), and a local-first upload
        (waited for by the final save) of a large checkpoint may rightly take long: for both the
        limit is at least `checkpoint.save_deadline_s` + the floor."""
        c = self.cfg.checkpoint
        return {"at_least": c.save_deadline_s + self.cfg.health.hang_floor_s} if c.async_save or c.local_dir else {}

    def eval_limits(self) -> dict[str, float]:
        return {"scale": max(1.0, self.cfg.train.eval_batches / self.trainer.grad_accum)}

    def run(self) -> int:
        """Train up to `train.steps`, then the final evaluation and checkpoint; returns the exit
        code (finished, or preempted)."""
        cfg, trainer = self.cfg, self.trainer
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, disable=not sys.stderr.isatty(),
                   desc="train", unit="step", dynamic_ncols=True)
        with PreemptionWatch(cfg.checkpoint.preempt_signals) as watch:
            try:
                if trainer.step > 0:  # resumed: the state is whole, so the staging memory is made during the first step
                    self.prepare_staging()
                if self.replicate:
                    with self.watch("save"):
                        self.save_local()
                while trainer.step < cfg.train.steps:
                    with self.watch("collective"):
                        stop = distributed.all_reduce_flag(watch.requested)  # one rank's signal stops all at this step
                    if stop:
                        return self.preempt(watch)
                    result = self.step_or_roll_back()
                    if result is None:
                        continue
                    self.poll()
                    self.train_s += result.seconds
                    self.clock.observe_step(result.seconds)
                    if self.local_clock is not None:
                        self.local_clock.observe_step(result.seconds)
                    self.record(result)
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss:.4f}")
                    self.debug.after_step(trainer.step)
                    self.evaluate_if_due()
                    # Not sticky: a finished run extended with a larger train.steps is unfinished again.
                    trainer.counters.finished = trainer.step >= cfg.train.steps
                    if distributed.rank0_flag(self.clock.due(trainer.step)):
                        with self.watch("save", **self.save_limits()):
                            self.save()
                    elif self.local_clock is not None and self.local_due(trainer.step):
                        with self.watch("save"):
                            self.save_local()
                    self.debug.end_of_step()
                if distributed.all_reduce_flag(watch.requested) and self.last_saved != trainer.step:
                    return self.preempt(watch)
                with self.watch("eval", **self.eval_limits()):
                    final_eval = trainer.evaluate()  # overlaps the final persist: the snapshot is a copy
                self.write_metrics({"step": trainer.step, **final_eval})
                with self.watch("save", **self.save_limits()):
                    self.finish_saves()  # "finished" means the final checkpoint is committed
            finally:
                bar.close()
                if self.watchdog is not None:
                    self.watchdog.close()
                self.metrics.close()
                self.trackers.close()
                self.saver.close()  # on an error exit: let a good in-flight save (and upload) end first
                if self.local_tier is not None:
                    self.local_tier.close()  # the same for a peer exchange, within a bound
        self.events.emit("exit", reason="finished", step=trainer.step, train_s=self.train_s, save_s=self.save_s)
        log.info("finished", step=trainer.step, **{k: round(v, 4) for k, v in final_eval.items()}, run_dir=cfg.run_dir)
        return exit_codes.FINISHED

    def step_or_roll_back(self) -> StepResult | None:
        """Train the next step inside the hang watchdog's `step` phase, the `[debug]` hang hooks
        first; None when it stopped on an anomaly and the loop rolled back past it (`anomaly`)."""
        try:
            with self.watch("step"):
                self.debug.in_step(self.trainer.step + 1)
                result = self.trainer.train_step()
        except TrainingDiverged as e:
            self.anomaly(e)
            return None
        if self.watchdog is not None:
            self.watchdog.observe_step(result.seconds)
        return result

    def evaluate_if_due(self) -> None:
        """Every `train.eval_every` steps, the task's eval metrics (`eval_loss`, ...) into the metrics.
        Not at the last step: its evaluation is the final one, after the loop (it overlaps the
        final persist)."""
        every, step = self.cfg.train.eval_every, self.trainer.step
        if every and step % every == 0 and step < self.cfg.train.steps:
            with self.watch("eval", **self.eval_limits()):
                self.write_metrics({"step": step, **self.trainer.evaluate()})

    def record(self, r) -> None:
        self.write_metrics({"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                            "tokens_per_s": r.tokens / r.seconds if r.seconds else None, "optim_s": r.optim_seconds,
                            "data_s": r.data_seconds,
                            "time": time.time(), **fingerprint_fields(r.fingerprint)})
        if r.step % self.cfg.train.log_every == 0 or r.step == self.cfg.train.steps:
            log.info("step", step=r.step, loss=round(r.loss, 4), grad_norm=round(r.grad_norm, 3))
            # Goodput needs the last step reached before a crash to count recomputed steps.
            self.events.emit("progress", step=r.step, train_s=self.train_s, save_s=self.save_s)

    def write_metrics(self, record: dict[str, Any]) -> None:
        """metrics.jsonl (the source of truth), then the trackers (a copy; never raise)."""
        self.metrics.write(record)
        self.trackers.write(record)

    def anomaly(self, error: TrainingDiverged) -> None:
        """A step stopped on an anomaly: roll back past it (`train.on_anomaly = "rollback"`,
        harness/run/rollback.py), or record it and raise `error` (a poisoned state, "stop", or
        past the rollback cap)."""
        a = error.anomaly
        try:
            if a is None or self.cfg.train.on_anomaly != "rollback":
                raise error
            roll_back(self, a)
        except TrainingDiverged as e:
            if a is not None:
                self.events.emit("anomaly", action="stop", step=a.step, batch=a.batch, cause=a.cause,
                                 value=str(a.value), error=str(e)[:500])
            raise

    def rolled_back(self, step: int) -> None:
        """The live state is the checkpoint of `step` again (harness/run/rollback.py)."""
        self.last_saved = step
        self.clock.saved(step)
        self.trackers.rewind(step)
        if self.local_tier is not None:
            assert self.local_clock is not None  # opened with the tier
            self.local_clock.saved(step)
            self.local_tier.drop_after(step)

    def hung(self, report: HangReport) -> None:
        """The hang watchdog fires (from its thread, just before it exits the process)."""
        exit_codes.record(exit_codes.HUNG)  # launchers behind torchrun learn the code from it
        self.events.emit("hang", phase=report.phase, step=report.step, limit_s=report.limit_s,
                         waited_s=report.waited_s, stacks=report.stacks, nccl_trace=report.nccl_trace)
        self.events.emit("exit", reason="hung", exit_code=exit_codes.HUNG, step=self.trainer.step,
                         train_s=self.train_s, save_s=self.save_s)

    def poll(self) -> None:
        """Between steps: raise a background save's or upload's failure, keep the writer lease fresh,
        and after the first step of a fresh run make the staging memory ready (`prepare_staging`)."""
        self.saver.poll()
        self.store.poll_lease()
        self.prepare_staging()

    def prepare_staging(self) -> None:
        """Make the saver's staging memory ready (the local tier shares it) in the background, once
        the state is whole: before the first step of a resumed run, after the first step of a fresh
        one (an optimizer makes its state there), so no save waits for the memory."""
        if not self.staging_ready:
            # The ring the two tiers share is made once, for the larger snapshot: the local tier's
            # (a rank's whole state) where there is one; the run dir's is a rank's per-rank parts
            # only, past rank 0 (a second, larger prepare would wait here for the first).
            (self.local_tier or self.saver).prepare(self.trainer.state.parts())
            self.staging_ready = True

    def finish_saves(self) -> None:
        """Wait until the newest checkpoint is committed (and, local-first, published remotely) and
        the local tier's last peer copy exchanged (it ran in the background meanwhile)."""
        self.saver.finish()
        if self.local_tier is not None:
            self.local_tier.finish()

    def save(self, must: bool = False) -> None:
        """Checkpoint the current step. Synchronous: commit it here. Async: snapshot it into the
        staging buffers and persist it in the background (`committed` reports the commit); with
        `checkpoint.when_busy = "skip"` a save due while the previous one persists is skipped,
        unless `must` or it is the final step. A state holding NaN/inf is never saved: that raises
        TrainingDiverged instead (every save goes through here: cadence, final, preemption)."""
        checked = self._check_finite_state()
        step = self.trainer.step
        submitted = self.saver.save(step, self.trainer.state.parts(), meta=self.checkpoint_meta(),
                                    must=must or step >= self.cfg.train.steps)
        if submitted is None:
            self.clock.saved(step)
            self.events.emit("checkpoint_skipped", step=step, reason="the previous save is still persisting")
            return
        blocking = checked + submitted.blocking_s
        self.save_s += blocking
        self.last_saved = step
        self.clock.saved(step, blocking)
        self.events.emit("checkpoint", step=step, blocking_s=blocking, background=self.saver.background)
        self.events.emit("progress", step=step, train_s=self.train_s, save_s=self.save_s)

    def _check_finite_state(self) -> float:
        """`Trainer.check_finite_state` (raises on a NaN/inf state); its seconds, which the step loop
        waits for as part of the save's blocking."""
        t0 = time.perf_counter()
        self.trainer.check_finite_state()
        return time.perf_counter() - t0

    def local_due(self, step: int) -> bool:
        """Whether the local tier saves at `step`. An "auto" interval is measured on each rank, so
        rank 0's decision is taken everywhere (every rank saves, and exchanges peer copies, at the
        same steps); a fixed one is the same on every rank already."""
        assert self.local_clock is not None  # called for a run with a local tier
        due = self.local_clock.due(step)
        return distributed.rank0_flag(due) if self.local_clock.auto else due

    def save_local(self) -> None:
        """Checkpoint the current step to the local tier (node-local disk or tmpfs), as the run dir's
        saves are taken (in the background or in this thread), with the same finite-state check as
        `save`; its peer copy is exchanged in the background (checkpoint/save/local_tier.py)."""
        assert self.local_tier is not None and self.local_clock is not None  # called for a run with a local tier
        checked = self._check_finite_state()
        step = self.trainer.step
        submitted = self.local_tier.save(step, self.trainer.state.parts(), self.checkpoint_meta())
        blocking = checked + submitted.blocking_s
        self.local_clock.saved(step, blocking)
        self.save_s += blocking
        self.events.emit("local_checkpoint", step=step, blocking_s=blocking, bytes=submitted.nbytes,
                         background=self.local_tier.background)

    def local_committed(self, done: Committed) -> None:
        """A local checkpoint is committed (from the local persist thread when saving in the background)."""
        assert self.local_tier is not None and self.local_clock is not None  # called for a run with a local tier
        self.local_clock.committed(done.persist_s)
        if self.local_tier.background:
            self.events.emit("local_committed", step=done.ref.step, persist_s=done.persist_s, bytes=done.nbytes)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What every checkpoint records beside the state: the config, the data's identity, the environment."""
        meta = {"config": public_config(self.cfg), "data": self.trainer.data.identity,
                "environment": environment_fingerprint(self.trainer.device)}
        if self.trainer.hf_config is not None:
            meta[HF_CONFIG_META] = self.trainer.hf_config
        return meta

    def committed(self, done: Committed) -> None:
        """A checkpoint is committed; called from the persist thread when saving in the background."""
        self.clock.committed(done.persist_s)
        self.events.emit("committed", step=done.ref.step, persist_s=done.persist_s, bytes=done.nbytes)

    def slow_save(self, step: int, seconds: float) -> None:
        self.events.emit("save_slow", step=step, seconds=seconds)

    def interval_chosen(self, choice: dict, tier: str = PERSISTENT) -> None:
        log.info("checkpoint interval chosen (Young/Daly)", tier=tier,
                 **{k: round(v, 4) if isinstance(v, float) else v for k, v in choice.items()})
        self.events.emit("checkpoint_interval", step=self.trainer.step, tier=tier, **choice)

    def preempt(self, watch: PreemptionWatch) -> int:
        step = self.trainer.step
        log.warning("preemption requested; saving", signal=watch.signal_name, step=step)

        def missed(code: int) -> None:
            try:
                self.events.emit("exit", reason="save_deadline_missed", exit_code=code, step=step,
                                 signal=watch.signal_name, train_s=self.train_s, save_s=self.save_s)
            finally:  # the exit is the promise (signals.SaveDeadline)
                os._exit(code)

        with SaveDeadline(self.cfg.checkpoint.preempt_deadline_s, since=watch.requested_at, exit=missed):
            if self.last_saved != step:
                self.save(must=True)
            self.finish_saves()  # PREEMPTED promises the newest checkpoint is committed
        self.events.emit("exit", reason="preempted", step=step, signal=watch.signal_name,
                         train_s=self.train_s, save_s=self.save_s)
        return exit_codes.PREEMPTED
