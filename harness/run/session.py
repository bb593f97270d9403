"""One training process from start to exit: lease, resume, run files and logs, the loop.

Contract of `train(cfg, ...)` (what `harness train` does):
- Takes the run dir's single-writer lease, finds the newest *good* checkpoint and resumes from it
  (`resume="auto"`; when every checkpoint is damaged it refuses, naming them, rather than start
  over), or starts fresh (`"never"`, refused when the run dir has good checkpoints), or loads the
  checkpoint at a given URL.
- Refuses to resume when a key that changes the math differs from the checkpoint's config, or
  the data's content fingerprint (`harness.data.identity`) differs from the one it recorded (each
  key with its old and new value in the message), unless `allow_config_change`; then the new values take effect
  from the first resumed step (optimizer and scheduler hyperparameters and the schedule come from
  the config and the task's code, optim/bundle.py, optim/schedulers.py) and a `config_changed`
  event records old -> new per key, per optimizer or scheduler setting built otherwise than the
  checkpoint's (`optimizers`) and any re-planned schedule; such a setting without a config change
  (the task's code changed) is refused the same way, naming both values. Warns when the torch
  version, device type or numerical settings (harness.repro.numerics) differ from the
  checkpoint's (bitwise equality is not promised there).
- With a local tier (`[checkpoint.local]`, checkpoint/save/local_tier.py; one process, DDP or FSDP) `--resume auto`
  also considers this run's local checkpoints and loads the newest step that verifies in either
  tier (with several ranks: on every rank; with peer copies, a part whose node lost it comes from
  the rank holding its copy, checkpoint/save/peer_copies.py);
  a local one that does not verify or is another run's is skipped and reported (a
  `checkpoint_rejected` event each). The `start` event names the tier resumed from.
- Resumes at another world size than the checkpoint's (harness/run/elastic.py): the global batch
  is kept (a world size it cannot split is refused before anything is written, naming the valid
  ones) and a `world_size_changed` event records old -> new world size and batch shape.
- A finished run started again says so and returns FINISHED without training.
- Checkpoints at the configured cadence and always at the last step; on a preemption signal,
  finishes the current step, saves within the deadline and returns PREEMPTED.
- Returns an exit code from `harness.exit_codes`.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import fsspec.utils
import psutil

from harness import exit_codes
from harness.checkpoint import PEER, PERSISTENT, CheckpointStore, LocalRecovery, LocalTier, place_writers
from harness.config import RunConfig
from harness.errors import Unavailable, UserError
from harness.health.trackers import open_trackers
from harness.log import get_logger
from harness.parallel import distributed
from harness.process import host_heap
from harness.records.events import EVENTS_FILE, EventLog
from harness.records.metrics import MetricsLog
from harness.records.run_files import METRICS_FILE, existing_run, log_dir_for, write_run_json
from harness.repro import numerics
from harness.run.device import process_device
from harness.run.elastic import fingerprint_checks
from harness.run.environment import environment_fingerprint
from harness.run.loop import Loop
from harness.run.resume import Resume
from harness.task import load_task, task_context
from harness.topology import topology_from_env

log = get_logger(__name__)


def train(cfg: RunConfig, *, resume: str = "auto", allow_config_change: bool = False,
          takeover: bool = False) -> int:
    # Before any torch math: MKL's mode is fixed at its first use.
    threads = numerics.apply(cfg.train.cpu_threads)["cpu_threads"]
    heap = host_heap.apply(cfg.train.host_heap)
    writers = place_writers(cfg.checkpoint.writer_cores, threads * topology_from_env().local_world_size)
    log_dir = Path(log_dir_for(cfg.run_dir, cfg.log_dir))
    if fsspec.utils.get_protocol(cfg.run_dir) == "memory":
        log.warning("run_dir is memory://: checkpoints and run.json live in this process only and are gone when it "
                    "exits; nothing can resume from them. Use a local path or s3:// for a real run",
                    run_dir=cfg.run_dir)
    task, world = load_task(cfg), distributed.world()
    # Opened once, here: a dataset that is not there (a url naming no prepared dataset) is refused before any write.
    data = task.data(task_context(cfg, distributed.rank(), world, process_device(cfg, world)))
    store = open_store(cfg)
    new_dir = new_local_dir(cfg.run_dir)
    try:
        distributed.on_rank0(store.acquire_lease, takeover=takeover)  # rank 0 is the run dir's one writer
    except OSError as e:
        raise UserError(f"cannot write to run dir {cfg.run_dir}: {e}; choose a writable --run-dir") from None
    try:
        starting = Resume(cfg, store, resume, allow_config_change, task=task, data=data,
                          local=local_source(cfg, resume))
        started = starting.start()
        if started is None:
            return exit_codes.FINISHED
        trainer, chosen, restore_s, resized = started.trainer, started.chosen, started.restore_s, started.resized
        cfg = trainer.cfg  # exact elastic mode decided: what the run trains with, and its checkpoints record
        ref = chosen.ref if chosen else None
        try:
            run_id, start = distributed.on_rank0(write_run_json, cfg, trainer.data.identity,
                                                 environment_fingerprint(trainer.device), started_from=trainer.step,
                                                 fresh=ref is None, initialised_from=trainer.initialised_from)
            log.debug("run", run_id=run_id, run_dir=cfg.run_dir, log_dir=str(log_dir), device=str(trainer.device),
                      resumed_from=ref.step if ref else None,
                      parameters=sum(p.numel() for p in trainer.model.parameters()))
            lead = distributed.rank() == 0  # rank 0 keeps the logs: every rank logs the same all-reduced loss
            if lead:
                log.info("data", **trainer.data.sizes(cfg.data.seq_len))
            events = EventLog(log_dir / EVENTS_FILE, run_id, cfg.run_dir) if lead else distributed.Silent()
            metrics = MetricsLog(log_dir / METRICS_FILE, run_id, cfg.run_dir) if lead else distributed.Silent()
            if cfg.debug.sample_log:
                trainer.batch_hook = distributed.SampleLog(log_dir).write
            t_check = time.perf_counter()
            ran_past = metrics.truncate_after(trainer.step) or []  # ranks > 0 keep no metrics (Silent: None)
            # Where the interrupted process got to: every step it logged, not only its last progress event.
            reached = max((int(r["step"]) for r in ran_past if "loss" in r), default=None)
            # Check the restored state, then each re-run step, against the run's own history.
            if ref is not None and lead:
                trainer.fingerprints.watch(events, [] if allow_config_change else ran_past,
                                           **fingerprint_checks(resized))
            restore_s += time.perf_counter() - t_check
            for rejected in starting.rejected:
                events.emit("checkpoint_rejected", **rejected)
            if chosen is not None:
                log.info("resumed", step=chosen.ref.step, tier=chosen.tier, url=chosen.ref.url,
                         restore_s=round(restore_s, 3),
                         steps_lost=None if reached is None else max(0, reached - chosen.ref.step))
            events.emit("start", step=trainer.step, total_steps=cfg.train.steps, resumed_from=ref.step if ref else None,
                        resumed_tier=chosen.tier if chosen else None, previous_reached=reached, run_dir=cfg.run_dir,
                        host=socket.gethostname(), startup_s=time.time() - psutil.Process().create_time(),
                        build_s=started.build_s, restore_s=restore_s, rss_bytes=psutil.Process().memory_info().rss,
                        world_size=distributed.world(),
                        saved_world_size=resized.old_world if resized else None, exact_elastic=trainer.exact,
                        exact_elastic_why=trainer.exact_why,
                        writer_cores=sorted(writers) if writers is not None else None, host_heap=heap)
            if resized is not None:
                events.emit("world_size_changed", **resized.event())
            if started.choice.changes or started.optimizer_changes:
                events.emit("config_changed", step=trainer.step,
                            changes={k: {"old": a, "new": b} for k, (a, b) in started.choice.changes.items()},
                            schedule=trainer.sched.replanned,
                            optimizers={k: {"old": a, "new": b} for k, (a, b) in started.optimizer_changes.items()})
            # Resumed from this run's own store: its checkpoint is the last one committed there.
            committed_here = chosen.ref.step if chosen is not None and chosen.store is store else None
            trackers = open_trackers(cfg.log, log_dir, trainer.step, run_id) if lead else distributed.Silent()
            tier = cfg.checkpoint.local
            local_tier = None if tier is None else LocalTier(tier, run_id, trainer.step, trainer.state.per_rank,
                                                             trainer.state.sharded,
                                                             peer_delay_s=cfg.debug.persist_delay_s, start=start)
            # The copies the lost ranks held for others are made again at once, paired for this world.
            replicate = chosen is not None and chosen.tier != PERSISTENT and (resized or chosen.tier == PEER)
            loop = Loop(cfg, trainer, store, metrics, events, log_dir,
                        last_committed=committed_here, trackers=trackers, local_tier=local_tier,
                        replicate=replicate and trainer.step < cfg.train.steps)
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
        remove_if_empty(new_dir)  # a start refused before it wrote anything leaves no empty run dir behind


def new_local_dir(run_dir: str) -> Path | None:
    """`run_dir` when it is a local folder that does not exist yet (this start creates it), else None."""
    if fsspec.utils.get_protocol(run_dir) != "file":
        return None
    path = Path(run_dir.removeprefix("file://"))
    return None if path.exists() else path


def remove_if_empty(path: Path | None) -> None:
    """Remove folder `path` if it is there and empty."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.rmdir()


def exit_reason(error: BaseException) -> tuple[str, int]:
    """The `exit` event's reason and the exit code the CLI gives for an exception leaving the loop."""
    if isinstance(error, UserError):
        return "user_error", error.exit_code
    if isinstance(error, Unavailable):
        return "storage_unavailable", error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    return "crashed", 1


def local_source(cfg: RunConfig, resume: str) -> LocalRecovery | None:
    """This run's local tier as a source to resume from: with `--resume auto` and a run id already
    in the run dir's run.json (before the first start no local checkpoint can be this run's); the
    copies this node holds of every rank (its own and peer copies: checkpoint/save/local_recovery.py).
    Collective: every rank calls it at the same point."""
    tier = cfg.checkpoint.local
    if tier is None or resume != "auto":
        return None
    # Rank 0 reads run.json for all: a rank slower to get here could find the one rank 0 has just
    # written for a fresh start (nothing in building an FSDP trainer holds rank 0 back), and ranks
    # that disagree on having a local source never meet in its collectives. This start is not in
    # its `starts` yet: rank 0 writes run.json after the resume.
    run_id, starts = distributed.on_rank0(existing_run, cfg)
    if run_id is None:
        return None
    return LocalRecovery(tier, run_id, tuple(starts))


def open_store(cfg: RunConfig) -> CheckpointStore:
    """The run dir's store. `checkpoint.local_dir` (commit there first, upload in the background:
    checkpoint/save/local_first.py) is the saver's business, and works with one process only."""
    c = cfg.checkpoint
    if c.local_dir is not None and distributed.is_distributed():
        raise UserError("checkpoint.local_dir works with one process only; with several ranks unset it "
                        "(every rank then writes its part straight to the run dir)")
    return CheckpointStore(cfg.run_dir, keep_last=c.keep_last, keep_every=c.keep_every,
                           storage_options=c.storage_options or None, lease_heartbeat_s=c.lease_heartbeat_s)
