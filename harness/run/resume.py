"""Which checkpoint a training process starts from, and loading it into a new `Trainer`.

`choose_checkpoint` turns `--resume auto|never|CKPT_URL` into candidates; `agree_on_checkpoint`
makes every rank of a group load the one rank 0 verified; `resume_newest` tries the candidates
newest first, verifying each while it loads, and refuses (`all_damaged`) a run dir whose every
checkpoint is damaged. With a local tier its choice joins the candidates by step (local first
at an equal step: it reads faster): every rank verifies the copies its node holds, and one
all-gather gives the newest step the surviving copies can rebuild for this world, at its world
size or another, the copies some ranks lack moved from the ranks holding them
(`LocalRecovery`, checkpoint/save/local_recovery.py); a copy passed over is recorded in
`LocalRecovery.rejected` (the caller emits `checkpoint_rejected` events). Exact elastic mode is
decided per candidate (harness/run/exact_mode.py). `check_compatible` refuses a changed math key
or other data unless `--allow-config-change`, and warns about another environment.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from harness.checkpoint import (
    PERSISTENT,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointRef,
    CheckpointStore,
    Coverage,
    LocalRecovery,
    Prefetch,
    Verify,
    load,
    locate,
    skipped,
)
from harness.config import RunConfig, config_changes
from harness.data.factory import is_iterator_source
from harness.data.sources import identity_changes, open_data
from harness.errors import UserError
from harness.log import get_logger
from harness.parallel import distributed
from harness.run.elastic import WorldChange, after_load
from harness.run.environment import warn_if_changed
from harness.run.exact_mode import AUTO, decide, saved_mode, with_mode
from harness.run.trainer import Trainer, resolve_device
from harness.storage.location import folder_name

log = get_logger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to resume from: its store, its ref, the tier it is in (`LOCAL`/`PEER`/
    `PERSISTENT`) and, for a local tier's copy, the rank that wrote it (`owner`) and the copies of
    the same step whose shards it reads (`shards`: (store, owner) each; LocalRecovery.choose)."""

    store: CheckpointStore
    ref: CheckpointRef
    tier: str
    owner: int | None = None
    shards: tuple[tuple[CheckpointStore, int], ...] = ()

    @property
    def step(self) -> int:
        return self.ref.step


@dataclass(frozen=True)
class Resumed:
    """What `resume_newest` started: the `trainer` (its `cfg` is the config the run trains with,
    exact elastic mode decided), the checkpoint it was restored from (`chosen`, None for a fresh
    start), the seconds spent reading, loading and verifying checkpoints (`restore_s`), the config
    changes since that checkpoint as `config_changes` gives them, the world-size change since it
    (`resized`, or None), why exact elastic mode is on or off (`exact_why`), and the seconds spent
    building the trainer (`build_s`: the model's initial weights, the optimizer; not in `restore_s`)."""

    trainer: Trainer
    chosen: Candidate | None
    restore_s: float
    changes: dict
    resized: WorldChange | None
    exact_why: str
    build_s: float


def resume_newest(cfg: RunConfig, source: CheckpointStore, candidates: list[CheckpointRef], verify: Verify,
                  allow_config_change: bool, local: LocalRecovery | None = None) -> Resumed | None:
    """The trainer restored from the newest good checkpoint (`Resumed`), or None when that is of
    a finished run (it says so on stderr; with `Verify.WHILE` that checkpoint is verified first,
    since it is not loaded). At another world size than the checkpoint's, every rank's random
    streams are restarted outside exact elastic mode (harness/run/elastic.py); the mode itself is
    decided per candidate (harness/run/exact_mode.py) and logged.

    `local`: a local tier whose copies are tried too, newest step first across both tiers (local
    first at an equal step: it reads faster); its choice is agreed by every rank and made whole
    (checkpoint/save/local_recovery.py) before anything is loaded, and verified again here.

    `candidates` are tried newest first, each read once (`source.open`: manifest and state.json)
    and passed down. With `Verify.WHILE` each is hashed as it loads (one read of every byte); one
    found damaged (`CheckpointCorrupt`) is logged and skipped, and the trainer is built anew for
    the next, since the damaged one was already partly streamed into it. A checkpoint that is
    intact but does not fit (another model width) is an error, never skipped."""
    restore_s = 0.0
    world = distributed.world()
    # Read once: every candidate is checked against it.
    data = open_data(cfg.data, cfg.train.seed, distributed.rank(), world)
    device = resolve_device(cfg.train.device).type
    iterator = is_iterator_source(data.train)
    tried = [Candidate(source, ref, PERSISTENT) for ref in candidates]
    if local is not None:
        t0 = time.perf_counter()  # with several ranks the local copies are verified here, before agreeing
        own = local.choose(Coverage(global_data=not iterator))
        own_candidates = [] if own is None else [Candidate(own.store, own.ref, own.tier, own.owner, own.shards)]
        tried = sorted(own_candidates + tried, key=lambda c: -c.step)  # stable: local first at an equal step
        restore_s += time.perf_counter() - t0
    for chosen in tried:
        source, ref = chosen.store, chosen.ref
        t0 = time.perf_counter()
        trainer = None
        try:
            checkpoint = source.open(ref)
            saved = checkpoint.state
            agreed, shard_copies = _agreed_local(local, chosen, checkpoint)
            if not agreed:
                restore_s += time.perf_counter() - t0
                continue
            exact, exact_why = decide(cfg, world, device, iterator, saved=saved_mode(saved["meta"]))
            run_cfg = with_mode(cfg, exact)
            changes = check_compatible(saved["meta"], run_cfg, allow_config_change, data.identity,
                                       mode_decided=cfg.parallel.exact_elastic == AUTO)
            # Whether the run finished is the trainer part's (state.TrainerCounters), nowhere else.
            if saved["parts"]["trainer"]["finished"] and ref.step >= cfg.train.steps:
                if _finished(cfg, source, ref, verify):
                    return None
                restore_s += time.perf_counter() - t0
                continue
            restore_s += time.perf_counter() - t0
            log.info("exact elastic mode", on=exact, why=exact_why)
            # The disk reads the checkpoint while the trainer it loads into is built (prefetch.py).
            with Prefetch(source.loc, ref, checkpoint.tensor_files):
                t_build = time.perf_counter()
                trainer = Trainer(run_cfg, rank=distributed.rank(), world_size=world, data=data)
                t0 = time.perf_counter()
                if trainer.sharded or checkpoint.sharded:
                    trainer.materialize_optimizer_state()  # read into live tensors of the right sharding
                # A local or peer checkpoint was verified above, and is one rank's own copy.
                local_copy = chosen.owner is not None
                load(source, checkpoint, trainer.state.parts(), verify=Verify.NO if local_copy else verify,
                     kept_on_new_rank=trainer.state.kept_on_new_rank, one_rank=local_copy,
                     shard_copies=shard_copies)
            resized = after_load(saved, run_cfg, ref.step, trainer.state.sharded)
            return Resumed(trainer, chosen, restore_s + time.perf_counter() - t0, changes, resized, exact_why,
                           build_s=t0 - t_build)
        except BaseException as e:
            if trainer is not None:
                trainer.close()
            if not isinstance(e, CheckpointCorrupt) or (verify is not Verify.WHILE and chosen.owner is None):
                raise  # an intact checkpoint that does not fit: the error is about the setup
            _reject(local, chosen, str(e))
            restore_s += time.perf_counter() - t0
    if candidates:
        raise all_damaged(cfg, candidates)
    exact, exact_why = decide(cfg, world, device, iterator)
    log.info("exact elastic mode", on=exact, why=exact_why)
    t_build = time.perf_counter()
    trainer = Trainer(with_mode(cfg, exact), rank=distributed.rank(), world_size=world, data=data, fresh=True)
    return Resumed(trainer, None, restore_s, {}, None, exact_why, build_s=time.perf_counter() - t_build)


def _finished(cfg: RunConfig, source: CheckpointStore, ref: CheckpointRef, verify: Verify) -> bool:
    """Whether the checkpoint `ref` of a run that reached its last step ends it (said on stderr):
    only if it is whole (verified first with `Verify.WHILE`, since it is not loaded); a damaged
    one is passed over like any other, and the steps after the one before are trained again."""
    problems = source.verify(ref) if verify is Verify.WHILE else []
    if problems:
        skipped(ref, problems)
        return False
    log.info("run already finished", step=ref.step, run_dir=cfg.run_dir)
    print(f"run already finished at step {ref.step}: {cfg.run_dir}", file=sys.stderr)
    return True


def _agreed_local(local: LocalRecovery | None, chosen: Candidate,
                  checkpoint: Checkpoint) -> tuple[bool, list[tuple[CheckpointStore, Checkpoint]]]:
    """(whether every rank may load `chosen`, the copies it reads its shards from): a persistent
    checkpoint always; a local one (every rank tries the same, agreed by `choose`) only when
    no rank finds a problem with its copy (`_local_problem`), so all load it or none."""
    if chosen.owner is None:
        return True, []
    problem, shard_copies = _local_problem(local, chosen, checkpoint)
    if distributed.all_ok(problem is None):
        return True, shard_copies
    if problem:
        _reject(local, chosen, problem)
    return False, shard_copies


def _reject(local: LocalRecovery | None, chosen: Candidate, problem: str) -> None:
    """Log a candidate passed over; a local tier's copy is also recorded in `local.rejected`."""
    skipped(chosen.ref, [problem])
    if chosen.owner is not None:
        local.rejected.append({"tier": chosen.tier, "step": chosen.ref.step, "url": chosen.ref.url,
                               "problem": problem[:300], "rank": distributed.rank()})


def _local_problem(local: LocalRecovery, chosen: Candidate,
                   checkpoint: Checkpoint) -> tuple[str | None, list[tuple[CheckpointStore, Checkpoint]]]:
    """Why the local copy `chosen` (opened: `checkpoint`) or one of the copies it reads its shards
    from must not be loaded (None: all are good; the cached verification of `LocalRecovery.problem`,
    so only a copy moved in is read again), and those copies opened."""
    problem = local.problem(chosen.store, chosen.ref, checkpoint.state, chosen.owner)
    shard_copies = []
    for store, owner in chosen.shards:
        copy = checkpoint if (store.url, owner) == (chosen.store.url, chosen.owner) else None
        try:
            copy = copy or store.open(store.ref(chosen.step))
        except CheckpointCorrupt as e:
            problem = problem or str(e)
            continue
        problem = problem or local.problem(store, copy.ref, copy.state, owner)
        shard_copies.append((store, copy))
    return problem, shard_copies


def all_damaged(cfg: RunConfig, damaged: list[CheckpointRef]) -> UserError:
    """The refusal to start over in a run dir whose every checkpoint fails verification: that
    would cut its metrics back to step 0 and let retention replace the evidence."""
    names = ", ".join(folder_name(ref.path) for ref in damaged)
    return UserError(f"every checkpoint in {cfg.run_dir} fails verification ({names}; the problems are logged "
                     f"above, `harness ckpt verify {cfg.run_dir}` lists them); nothing was changed. Restore a good "
                     f"copy, or pass --resume never to start over from step 0 (the damaged ones are kept until "
                     f"good checkpoints replace them)")


def agree_on_checkpoint(store: CheckpointStore, cfg: RunConfig,
                        resume: str) -> tuple[CheckpointStore, list[CheckpointRef], Verify]:
    """`choose_checkpoint`; with several ranks, rank 0 picks and verifies one checkpoint (every
    byte read once) and every rank loads that one, so ranks never load different checkpoints."""
    if not distributed.is_distributed():
        return choose_checkpoint(store, cfg, resume)

    def decide() -> tuple[str | None, int] | None:
        source, candidates, verify = choose_checkpoint(store, cfg, resume)
        ref = source.first_good(candidates) if verify is Verify.WHILE else next(iter(candidates), None)
        if ref is None and candidates:
            raise all_damaged(cfg, candidates)
        return None if ref is None else (None if source is store else source.url, ref.step)

    choice = distributed.on_rank0(decide)
    if choice is None:
        return store, [], Verify.NO
    url, step = choice
    source = store if url is None else CheckpointStore(url, storage_options=cfg.checkpoint.storage_options or None)
    return source, [source.ref(step)], Verify.NO


def choose_checkpoint(store: CheckpointStore, cfg: RunConfig,
                      resume: str) -> tuple[CheckpointStore, list[CheckpointRef], Verify]:
    """(the store to load from, the checkpoints to try newest first, how to verify them while
    loading) for `--resume auto|never|CKPT_URL`. `auto` verifies while loading (see
    `resume_newest`); a checkpoint given by URL was verified here already."""
    if resume == "auto":
        return store, store.candidates(), Verify.WHILE
    if resume == "never":
        existing = store.latest_good()
        if existing is not None:
            raise UserError(f"--resume never, but {cfg.run_dir} already has checkpoints (newest: step "
                            f"{existing.step}); use another --run-dir, or --resume auto to continue it")
        return store, [], Verify.NO
    source, ref = checkpoint_at(resume, cfg.checkpoint.storage_options)
    return source, [ref], Verify.NO


def checkpoint_at(url: str, storage_options: dict[str, Any]) -> tuple[CheckpointStore, CheckpointRef]:
    """The checkpoint folder `RUN_DIR/checkpoints/step-N` at `url` (read as `harness ckpt` reads
    it: `locate`), verified."""
    source, ref = locate(url, storage_options or None)
    if ref is None or ref.path != source.ref(ref.step).path:  # every rank finds it by its step
        raise UserError(f"--resume {url}: expected a checkpoint folder RUN_DIR/checkpoints/step-NNNNNNNN, "
                        f"or auto / never")
    if not source.loc.fs.isdir(ref.path):
        raise UserError(f"--resume {url}: no such checkpoint folder; `harness ckpt ls {source.url}` lists the "
                        f"run's checkpoints (or use --resume auto for the newest good one)")
    problems = source.verify(ref)
    if problems:
        raise UserError(f"--resume {url}: the checkpoint fails verification: {problems[0]}")
    return source, ref


def check_compatible(meta: dict[str, Any], cfg: RunConfig, allow_config_change: bool,
                     data_identity: dict[str, Any] | None, mode_decided: bool = False) -> dict[str, tuple[Any, Any]]:
    """The math keys changed since the checkpoint (`config_changes`) and what differs in the data's
    identity (`identity_changes`); raises UserError when there are any and `allow_config_change` is off.
    `mode_decided`: `parallel.exact_elastic` is "auto" in the config and `cfg` holds the mode the
    run decided (exact_mode.py): a change of it is that decision's, logged there, not the user's."""
    changed = config_changes(meta["config"], cfg)
    if mode_decided:
        changed.pop("parallel.exact_elastic", None)
    changed.update(identity_changes(meta.get("data"), data_identity))
    if changed and not allow_config_change:
        raise UserError(f"the config changes the math of the run in {cfg.run_dir}: {', '.join(changed)} differ "
                        f"from the checkpoint; restore them, use a new --run-dir, or pass --allow-config-change")
    if changed:
        log.warning("resuming with a changed config; the new values apply from the first resumed step, bitwise "
                    "equality is not promised", changes={k: f"{a!r} -> {b!r}" for k, (a, b) in changed.items()})
    warn_if_changed(meta.get("environment", {}), resolve_device(cfg.train.device))
    return changed
