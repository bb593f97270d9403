"""One training process from start to exit: resume decision, the loop around the trainer, saving.

Contract of `train(cfg, ...)` (what `harness train` does):
- Takes the run dir's single-writer lease, finds the newest *good* checkpoint and resumes from it
  (`resume="auto"`; when every checkpoint is damaged it refuses, naming them, rather than start
  over), or starts fresh (`"never"`, refused when the run dir has good checkpoints), or loads the
  checkpoint at a given URL.
- Refuses to resume when a key that changes the math differs from the checkpoint's config, or
  the data's content fingerprint (`harness.data.identity`) differs from the one it recorded (the
  list of keys is in the message), unless `allow_config_change`; then the new values take effect
  from the first resumed step (optimizer hyperparameters and the schedule come from the config,
  optim/bundle.py) and a `config_changed` event records old -> new per key and any re-planned
  schedule. Warns when the torch version, device type or numerical settings (harness.numerics)
  differ from the checkpoint's (bitwise equality is not promised there).
- A finished run started again says so and returns FINISHED without training.
- Checkpoints at the configured cadence and always at the last step; on a preemption signal,
  finishes the current step, saves within the deadline and returns PREEMPTED.
- Returns an exit code from `harness.exit_codes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import fsspec.utils
import psutil
from tqdm import tqdm

from harness import distributed, exit_codes, numerics
from harness.checkpoint import CheckpointRef, CheckpointStore, capture
from harness.checkpoint.async_save import AsyncSaver, Committed
from harness.checkpoint.distributed_commit import GroupCommit, load_checkpoint
from harness.checkpoint.filesystem import open_filesystem
from harness.checkpoint.mirror import LocalFirstStore
from harness.checkpoint.errors import CheckpointCorrupt, CheckpointError, failed_save
from harness.checkpoint.store import CHECKPOINTS_DIR, STEP_DIR, Verify, folder_name, skipped
from harness.config import RunConfig, config_changes, public_config
from harness.data.sources import identity_changes, open_data
from harness.errors import Unavailable, UserError
from harness.events import EVENTS_FILE, EventLog, log_dir_for
from harness.jsonlines import parse_line
from harness.run_id import RUN_ID_KEY, RUN_JSON, new_run_id
from harness.fingerprint import fingerprint_fields
from harness.log import get_logger
from harness.metrics import MetricsLog
from harness.signals import PreemptionWatch, SaveDeadline
from harness.trainer import CRASH_EXIT_CODE, CheckpointClock, Trainer, environment_fingerprint, resolve_device

log = get_logger(__name__)


def train(cfg: RunConfig, *, resume: str = "auto", allow_config_change: bool = False,
          takeover: bool = False) -> int:
    numerics.apply(cfg.train.cpu_threads)  # before any torch math: MKL's mode is fixed at its first use
    log_dir = Path(resolve_log_dir(cfg))
    if fsspec.utils.get_protocol(cfg.run_dir) == "memory":
        log.warning("run_dir is memory://: checkpoints and run.json live in this process only and are gone when it "
                    "exits; nothing can resume from them. Use a local path or s3:// for a real run", run_dir=cfg.run_dir)
    store = open_store(cfg)
    try:
        distributed.on_rank0(store.acquire_lease, takeover=takeover)  # rank 0 is the run dir's one writer
    except OSError as e:
        raise UserError(f"cannot write to run dir {cfg.run_dir}: {e}; choose a writable --run-dir") from None
    try:
        source, candidates, verify = agree_on_checkpoint(store, cfg, resume)
        started = resume_newest(cfg, source, candidates, verify, allow_config_change)
        if started is None:
            return exit_codes.FINISHED
        trainer, ref, restore_s, changes = started
        try:
            run_id = distributed.on_rank0(write_run_json, cfg, trainer)
            log.debug("run", run_id=run_id, run_dir=cfg.run_dir, log_dir=str(log_dir), device=str(trainer.device),
                      resumed_from=ref.step if ref else None, parameters=sum(p.numel() for p in trainer.model.parameters()))
            lead = distributed.rank() == 0  # rank 0 keeps the logs: every rank logs the same all-reduced loss
            events = EventLog(log_dir / EVENTS_FILE, run_id, cfg.run_dir) if lead else distributed.Silent()
            metrics = MetricsLog(log_dir / "metrics.jsonl", run_id, cfg.run_dir) if lead else distributed.Silent()
            if cfg.debug.sample_log:
                trainer.batch_hook = distributed.SampleLog(log_dir).write
            t_check = time.perf_counter()
            ran_past = metrics.truncate_after(trainer.step) or []  # ranks > 0 keep no metrics (Silent: None)
            # Where the interrupted process got to: every step it logged, not only its last progress event.
            reached = max((int(r["step"]) for r in ran_past if "loss" in r), default=None)
            if ref is not None and lead:  # check the restored state, then each re-run step, against the run's own history
                trainer.fingerprints.watch(events, [] if allow_config_change else ran_past)
            restore_s += time.perf_counter() - t_check
            events.emit("start", step=trainer.step, resumed_from=ref.step if ref else None, previous_reached=reached,
                        run_dir=cfg.run_dir,
                        host=socket.gethostname(), startup_s=time.time() - psutil.Process().create_time(),
                        restore_s=restore_s)
            if changes:
                events.emit("config_changed", step=trainer.step, changes={k: {"old": a, "new": b} for k, (a, b) in changes.items()},
                            schedule=trainer.sched.replanned)
            resumed_here = ref is not None and source is store
            loop = Loop(cfg, trainer, store, metrics, events, log_dir, last_committed=ref.step if resumed_here else None)
            try:
                return loop.run()
            except BaseException as e:
                reason, code = exit_reason(e)
                with contextlib.suppress(OSError):  # a full log disk must not replace the error being raised
                    events.emit("exit", reason=reason, exit_code=code, step=trainer.step, train_s=loop.train_s,
                                save_s=loop.save_s, error=f"{type(e).__name__}: {e}"[:500])
                raise
        finally:
            trainer.close()
    finally:
        store.release_lease()


def exit_reason(error: BaseException) -> tuple[str, int]:
    """The `exit` event's reason and the exit code the CLI gives for an exception leaving the loop."""
    if isinstance(error, UserError):
        return "user_error", error.exit_code
    if isinstance(error, Unavailable):
        return "storage_unavailable", error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    return "crashed", 1


def resume_newest(cfg: RunConfig, source: CheckpointStore, candidates: list[CheckpointRef], verify: Verify,
                  allow_config_change: bool) -> tuple[Trainer, CheckpointRef | None, float, dict] | None:
    """(trainer, the checkpoint it was restored from or None for a fresh start, seconds spent
    reading, loading and verifying checkpoints, the config changes since that checkpoint as
    `config_changes` gives them), or None when the newest checkpoint is of a finished run (it
    says so on stderr).

    `candidates` are tried newest first. With `verify="while"` each is hashed as it loads (one
    read of every byte); one found damaged is logged and skipped, and the trainer is built anew
    for the next, since the damaged one was already partly streamed into it. A checkpoint that
    is intact but does not fit (another model width) is an error, never skipped."""
    restore_s = 0.0
    data = open_data(cfg.data, cfg.train.seed)  # read once: every candidate is checked against it
    for ref in candidates:
        t0 = time.perf_counter()
        trainer = None
        try:
            saved = source.read_state(ref)
            changes = check_compatible(saved["meta"], cfg, allow_config_change, data.identity)
            if saved["meta"].get("finished") and ref.step >= cfg.train.steps:
                log.info("run already finished", step=ref.step, run_dir=cfg.run_dir)
                print(f"run already finished at step {ref.step}: {cfg.run_dir}", file=sys.stderr)
                return None
            restore_s += time.perf_counter() - t0
            trainer = Trainer(cfg, rank=distributed.rank(), world_size=distributed.world(), data=data)
            t0 = time.perf_counter()
            load_checkpoint(source, ref, trainer.state.parts(), verify=verify)
            return trainer, ref, restore_s + time.perf_counter() - t0, changes
        except BaseException as e:
            if trainer is not None:
                trainer.close()
            if verify != "while" or not isinstance(e, CheckpointError):
                raise
            problems = [str(e)] if isinstance(e, CheckpointCorrupt) else source.verify(ref)
            if not problems:  # intact: the error is about the setup, not the checkpoint
                raise
            skipped(ref, problems)
            restore_s += time.perf_counter() - t0
    if candidates:
        raise all_damaged(cfg, candidates)
    return Trainer(cfg, rank=distributed.rank(), world_size=distributed.world(), data=data), None, restore_s, {}


def all_damaged(cfg: RunConfig, damaged: list[CheckpointRef]) -> UserError:
    """The refusal to start over in a run dir whose every checkpoint fails verification: that
    would cut its metrics back to step 0 and let retention replace the evidence."""
    names = ", ".join(folder_name(ref.path) for ref in damaged)
    return UserError(f"every checkpoint in {cfg.run_dir} fails verification ({names}; the problems are logged "
                     f"above, `harness ckpt verify {cfg.run_dir}` lists them); nothing was changed. Restore a good "
                     f"copy, or pass --resume never to start over from step 0 (the damaged ones are kept until "
                     f"good checkpoints replace them)")


def open_store(cfg: RunConfig) -> CheckpointStore | LocalFirstStore:
    """The run dir's store; with `checkpoint.local_dir`, committing there first and uploading
    to the run dir in the background (checkpoint/mirror.py)."""
    c = cfg.checkpoint
    store = CheckpointStore(cfg.run_dir, keep_last=c.keep_last, keep_every=c.keep_every,
                            storage_options=c.storage_options or None, lease_heartbeat_s=c.lease_heartbeat_s)
    if c.local_dir is None:
        return store
    if distributed.is_distributed():
        raise UserError("checkpoint.local_dir works with one process only; with several ranks unset it "
                        "(every rank then writes its part straight to the run dir)")
    return LocalFirstStore(store, c.local_dir)


def resolve_log_dir(cfg: RunConfig) -> str:
    """Local folder for metrics and events (`harness.events.log_dir_for`)."""
    return log_dir_for(cfg.run_dir, cfg.log_dir)


def agree_on_checkpoint(store: CheckpointStore, cfg: RunConfig,
                        resume: str) -> tuple[CheckpointStore, list[CheckpointRef], Verify]:
    """`choose_checkpoint`; with several ranks, rank 0 picks and verifies one checkpoint (every
    byte read once) and every rank loads that one, so ranks never load different checkpoints."""
    if not distributed.is_distributed():
        return choose_checkpoint(store, cfg, resume)

    def decide() -> tuple[str | None, int] | None:
        source, candidates, verify = choose_checkpoint(store, cfg, resume)
        ref = source.first_good(candidates) if verify == "while" else next(iter(candidates), None)
        if ref is None and candidates:
            raise all_damaged(cfg, candidates)
        return None if ref is None else (None if source is store else source.url, ref.step)

    choice = distributed.on_rank0(decide)
    if choice is None:
        return store, [], "no"
    url, step = choice
    source = store if url is None else CheckpointStore(url, storage_options=cfg.checkpoint.storage_options or None)
    return source, [source.ref(step)], "no"


def choose_checkpoint(store: CheckpointStore, cfg: RunConfig,
                      resume: str) -> tuple[CheckpointStore, list[CheckpointRef], Verify]:
    """(the store to load from, the checkpoints to try newest first, how to verify them while
    loading) for `--resume auto|never|CKPT_URL`. `auto` verifies while loading (see
    `resume_newest`); a checkpoint given by URL was verified here already."""
    if resume == "auto":
        return store, store.candidates(), "while"
    if resume == "never":
        existing = store.latest_good()
        if existing is not None:
            raise UserError(f"--resume never, but {cfg.run_dir} already has checkpoints (newest: step "
                            f"{existing.step}); use another --run-dir, or --resume auto to continue it")
        return store, [], "no"
    source, ref = checkpoint_at(resume, cfg.checkpoint.storage_options)
    return source, [ref], "no"


def checkpoint_at(url: str, storage_options: dict[str, Any]) -> tuple[CheckpointStore, CheckpointRef]:
    """The checkpoint folder `RUN_DIR/checkpoints/step-N` at `url`, verified."""
    head, _, name = url.rstrip("/").rpartition("/")
    run_url, _, parent = head.rpartition("/")
    match = STEP_DIR.fullmatch(name)
    if not match or parent != CHECKPOINTS_DIR:
        raise UserError(f"--resume {url}: expected a checkpoint folder RUN_DIR/{CHECKPOINTS_DIR}/step-NNNNNNNN, "
                        f"or auto / never")
    source = CheckpointStore(run_url or ".", storage_options=storage_options or None)
    ref = source.ref(int(match[1]))
    if not source.loc.fs.isdir(ref.path):
        raise UserError(f"--resume {url}: no such checkpoint folder; `harness ckpt ls {run_url or '.'}` lists the "
                        f"run's checkpoints (or use --resume auto for the newest good one)")
    problems = source.verify(ref)
    if problems:
        raise UserError(f"--resume {url}: the checkpoint fails verification: {problems[0]}")
    return source, ref


def check_compatible(meta: dict[str, Any], cfg: RunConfig, allow_config_change: bool,
                     data_identity: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """The math keys changed since the checkpoint (`config_changes`) and what differs in the data's
    identity (`identity_changes`); raises UserError when there are any and `allow_config_change` is off."""
    changed = config_changes(meta["config"], cfg)
    changed.update(identity_changes(meta.get("data"), data_identity))
    if changed and not allow_config_change:
        raise UserError(f"the config changes the math of the run in {cfg.run_dir}: {', '.join(changed)} differ "
                        f"from the checkpoint; restore them, use a new --run-dir, or pass --allow-config-change")
    if changed:
        log.warning("resuming with a changed config; the new values apply from the first resumed step, bitwise "
                    "equality is not promised", changes={k: f"{a!r} -> {b!r}" for k, (a, b) in changed.items()})
    before = meta.get("environment", {})
    now = environment_fingerprint(resolve_device(cfg.train.device))
    differ = [(key, before[key], now[key]) for key in ("torch", "device_type") if key in before and before[key] != now[key]]
    saved_numerics = before.get("numerics", {})
    differ += [(f"numerics.{key}", saved_numerics[key], now["numerics"][key])
               for key in numerics.RESUME_SENSITIVE if key in saved_numerics and saved_numerics[key] != now["numerics"][key]]
    for key, then, current in differ:
        log.warning("resuming on a different environment; bitwise equality is not promised there",
                    key=key, checkpoint=then, now=current)
    return changed


def write_run_json(cfg: RunConfig, trainer: Trainer) -> str:
    """Write the run dir's run.json (resolved config, environment, run id) and return the run id:
    the one already in run.json, else a new one (`harness.run_id`)."""
    try:
        # Through the store's filesystem: bounded retries that never draw from the global RNG.
        fs, path = open_filesystem(cfg.run_dir, cfg.checkpoint.storage_options)
        url = f"{path.rstrip('/')}/{RUN_JSON}"
        previous = parse_line(fs.cat_file(url)) if fs.exists(url) else None
        run_id = (previous or {}).get(RUN_ID_KEY) or new_run_id()
        doc = {RUN_ID_KEY: run_id, "config": public_config(cfg), "data": trainer.data.identity,
               "environment": environment_fingerprint(trainer.device)}
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(url, json.dumps(doc, indent=2).encode())
    except OSError as e:
        raise UserError(f"cannot write to run dir {cfg.run_dir}: {e}; choose a writable --run-dir") from None
    return run_id


class Loop:
    """The outer loop: steps, metrics, evaluation, checkpoint cadence, preemption, fault hooks."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, store: CheckpointStore, metrics: MetricsLog,
                 events: EventLog, log_dir: Path, last_committed: int | None = None) -> None:
        self.cfg, self.trainer, self.store, self.metrics, self.events = cfg, trainer, store, metrics, events
        self.log_dir = log_dir
        self.last_committed = last_committed  # the newest checkpoint of the run dir known to be committed
        c = cfg.checkpoint
        self.clock = CheckpointClock(c.every_steps, c.every_minutes, cfg.train.steps, mtbf_s=c.mtbf_hours * 3600.0,
                                     report=self.interval_chosen)
        # In the background, with several ranks, the commit's collectives run on a gloo group of
        # their own: see harness/checkpoint/distributed_commit.py.
        side = distributed.new_side_group(c.save_deadline_s) if c.async_save else None
        self.commit = GroupCommit(store, group=side, fail_rank=cfg.debug.fail_save_rank,
                                  fail_step=cfg.debug.fail_save_step)
        self.saver = AsyncSaver(store, when_busy=c.when_busy, on_commit=self.committed,
                                persist_delay_s=cfg.debug.persist_delay_s, save_deadline_s=c.save_deadline_s,
                                on_slow=self.slow_save, commit=self.commit, rank=distributed.rank(),
                                select=self.commit.mine, agree=distributed.all_reduce_flag,
                                last_committed=last_committed) if c.async_save else None
        # Local-first: a checkpoint counts as saved once its upload is published (finish waits for it).
        self.uploads = store if isinstance(store, LocalFirstStore) else None
        self.last_saved = trainer.step
        self.train_s = 0.0
        self.save_s = 0.0

    def run(self) -> int:
        cfg, trainer = self.cfg, self.trainer
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, disable=not sys.stderr.isatty(),
                   desc="train", unit="step", dynamic_ncols=True)
        with PreemptionWatch(cfg.checkpoint.preempt_signals) as watch:
            try:
                while trainer.step < cfg.train.steps:
                    if distributed.all_reduce_flag(watch.requested):  # one rank's signal stops all at this step
                        return self.preempt(watch)
                    result = trainer.train_step()
                    self.poll()
                    self.train_s += result.seconds
                    self.clock.observe_step(result.seconds)
                    self.record(result)
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss:.4f}")
                    self.crash_hook()
                    if cfg.train.eval_every and trainer.step % cfg.train.eval_every == 0:
                        self.metrics.write({"step": trainer.step, "eval_loss": trainer.evaluate()})
                    # Not sticky: a finished run extended with a larger train.steps is unfinished again.
                    trainer.counters.finished = trainer.step >= cfg.train.steps
                    if distributed.rank0_flag(self.clock.due(trainer.step)):
                        self.save()
                    if cfg.debug.step_sleep_s:
                        time.sleep(cfg.debug.step_sleep_s)
                if distributed.all_reduce_flag(watch.requested) and self.last_saved != trainer.step:
                    return self.preempt(watch)
                final_eval = trainer.evaluate()  # overlaps the final persist: the snapshot is a copy
                self.metrics.write({"step": trainer.step, "eval_loss": final_eval})
                self.finish_saves()  # "finished" means the final checkpoint is committed
            finally:
                bar.close()
                self.metrics.close()
                if self.saver is not None:
                    self.saver.close()  # on an error exit: let a good in-flight save commit first
                if self.uploads is not None:
                    self.uploads.close()
        self.events.emit("exit", reason="finished", step=trainer.step, train_s=self.train_s, save_s=self.save_s)
        log.info("finished", step=trainer.step, eval_loss=round(final_eval, 4), run_dir=cfg.run_dir)
        return exit_codes.FINISHED

    def record(self, r) -> None:
        self.metrics.write({"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                            "tokens_per_s": r.tokens / r.seconds if r.seconds else None, "optim_s": r.optim_seconds,
                            "data_s": r.data_seconds,
                            "time": time.time(), **fingerprint_fields(r.fingerprint)})
        if r.step % self.cfg.train.log_every == 0 or r.step == self.cfg.train.steps:
            log.info("step", step=r.step, loss=round(r.loss, 4), grad_norm=round(r.grad_norm, 3))
            # Goodput needs the last step reached before a crash to count recomputed steps.
            self.events.emit("progress", step=r.step, train_s=self.train_s, save_s=self.save_s)

    def poll(self) -> None:
        """Between steps: raise a background save's or upload's failure, keep the writer lease fresh."""
        if self.saver is not None:
            self.saver.poll()
        if self.uploads is not None:
            self.uploads.poll()
        self.store.poll_lease()

    def finish_saves(self) -> None:
        """Wait until the newest checkpoint is committed (and, local-first, published remotely)."""
        if self.saver is not None:
            self.saver.finish()
        if self.uploads is not None:
            self.uploads.finish()

    def save(self, must: bool = False) -> None:
        """Checkpoint the current step. Synchronous: commit it here. Async: snapshot it into the
        staging buffers and persist it in the background (`committed` reports the commit); with
        `checkpoint.when_busy = "skip"` a save due while the previous one persists is skipped,
        unless `must` or it is the final step. A state holding NaN/inf is never saved: that raises
        TrainingDiverged instead (every save goes through here: cadence, final, preemption)."""
        self.trainer.check_finite_state()
        step = self.trainer.step
        meta = {"config": public_config(self.cfg), "data": self.trainer.data.identity,
                "finished": self.trainer.counters.finished, "environment": environment_fingerprint(self.trainer.device)}
        if self.saver is None:
            t0 = time.perf_counter()
            snapshot = capture(self.trainer.state.parts(), rank=distributed.rank())
            try:
                ref = self.commit(step, snapshot, meta=meta)
            except OSError as e:
                raise failed_save(step, e, self.last_committed, self.cfg.run_dir) or e
            blocking = time.perf_counter() - t0
            self.committed(Committed(ref, blocking, snapshot.nbytes))
        else:
            submitted = self.saver.submit(step, self.trainer.state.parts(), meta=meta,
                                          must=must or step >= self.cfg.train.steps)
            if submitted is None:
                self.clock.saved(step)
                self.events.emit("checkpoint_skipped", step=step, reason="the previous save is still persisting")
                return
            blocking = submitted.blocking_s
        self.save_s += blocking
        self.last_saved = step
        self.clock.saved(step, blocking)
        self.events.emit("checkpoint", step=step, blocking_s=blocking, background=self.saver is not None)
        self.events.emit("progress", step=step, train_s=self.train_s, save_s=self.save_s)

    def committed(self, done: Committed) -> None:
        """A checkpoint is committed; called from the persist thread when saving in the background."""
        self.clock.committed(done.persist_s)
        self.last_committed = done.ref.step
        self.events.emit("committed", step=done.ref.step, persist_s=done.persist_s, bytes=done.nbytes)

    def slow_save(self, step: int, seconds: float) -> None:
        self.events.emit("save_slow", step=step, seconds=seconds)

    def interval_chosen(self, choice: dict) -> None:
        log.info("checkpoint interval chosen (Young/Daly)",
                 **{k: round(v, 4) if isinstance(v, float) else v for k, v in choice.items()})
        self.events.emit("checkpoint_interval", step=self.trainer.step, **choice)

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

    def crash_hook(self) -> None:
        """debug.crash_at_step: die like a real crash would, to test restarts."""
        d = self.cfg.debug
        if d.crash_at_step is None or self.trainer.step != d.crash_at_step:
            return
        marker = self.log_dir / f".crashed-at-{d.crash_at_step}"
        if d.crash_once and marker.exists():
            return
        marker.touch()
        if d.crash_mode == "raise":
            raise RuntimeError(f"debug.crash_at_step: planned crash after step {d.crash_at_step}")
        os._exit(CRASH_EXIT_CODE)
