"""Which checkpoint a training process starts from, and loading it into a new `Trainer`: `Resume`
(candidates, choice, restore).

`choose_checkpoint` turns `--resume auto|never|CKPT_URL` into candidates; `agree_on_checkpoint`
makes every rank of a group load the one rank 0 verified. With a local tier its choice joins the
candidates by step: every rank verifies the copies its node holds, and one all-gather gives the
newest step the surviving copies can rebuild for this world, at its world size or another, the
copies some ranks lack moved from the ranks holding them (`LocalRecovery`,
checkpoint/save/local_recovery.py); a copy passed over is recorded in `Resume.rejected` (the
caller emits `checkpoint_rejected` events). Exact elastic mode is decided by the trainer built for
a candidate, from the mode the candidate was trained in (harness/run/exact_mode.py).
`check_compatible` refuses a changed math key or other data unless `--allow-config-change`, and
warns about another environment.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

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
from harness.data.sources import TrainData, identity_changes
from harness.errors import UserError
from harness.log import get_logger
from harness.parallel import distributed
from harness.run.device import process_device
from harness.run.elastic import WorldChange, after_load
from harness.run.environment import warn_if_changed
from harness.run.exact_mode import AUTO, saved_mode
from harness.run.trainer import Trainer
from harness.storage.location import folder_name
from harness.task import BoundTask, load_task, task_context

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


class PassedOver(Exception):
    """A chosen checkpoint was found damaged while it loaded, and passed over (`Resume.restore`)."""


@dataclass(frozen=True)
class Choice:
    """What a training process starts from: the `candidate` (None: a fresh start) opened
    (`checkpoint`, its shards' copies `shard_copies` for a local candidate), the exact elastic mode
    it was trained in (`saved_exact`; None for a fresh start: the trainer decides the mode the run
    trains in), and the config changes since the checkpoint (`changes`, as `config_changes` gives
    them)."""

    candidate: Candidate | None
    saved_exact: bool | None = None
    checkpoint: Checkpoint | None = None
    changes: dict = field(default_factory=dict)
    shard_copies: tuple[tuple[CheckpointStore, Checkpoint], ...] = ()


@dataclass(frozen=True)
class Started:
    """A trainer restored (`choice`: from where and how), the seconds spent reading, loading and
    verifying checkpoints (`restore_s`), the world-size change since the checkpoint (`resized`,
    or None), the seconds spent building the trainer (`build_s`: the model's initial weights,
    the optimizer; not in `restore_s`), and the optimizer and scheduler settings built otherwise
    than the checkpoint's (`optimizer_changes`, as `built_changes` gives them: allowed, in force)."""

    trainer: Trainer
    choice: Choice
    restore_s: float
    resized: WorldChange | None
    build_s: float
    optimizer_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def chosen(self) -> Candidate | None:
        return self.choice.candidate


class Resume:
    """Where a training process starts, in three steps: the `candidates` (the run dir's checkpoints
    as `--resume` names them, with the local tier's agreed choice among them: newest step first,
    local first at an equal step, it reads faster), the `choose`n one (the newest whose manifest
    and state open, whose local copies are whole and whose config fits; None for a run that
    finished), and its `restore` into a trainer built for that choice. `start` does the three.

    A candidate found damaged is passed over (`rejected` lists the local tier's, for the
    `checkpoint_rejected` events). Most damage shows before a trainer exists (a manifest, a local
    copy's verification); a persistent checkpoint verified while it loads (one read of every
    byte) can only show it part-way into the trainer, which is then thrown away and built anew
    for the next choice. When every checkpoint of the run dir is damaged, `all_damaged` refuses to
    start over. A checkpoint that is intact but does not fit (another model width) is an error,
    never passed over."""

    def __init__(self, cfg: RunConfig, store: CheckpointStore, resume: str = "auto", allow_config_change: bool = False,
                 *, task: BoundTask | None = None, data: TrainData | None = None,
                 local: LocalRecovery | None = None) -> None:
        """`resume`: auto | never | a checkpoint URL; `task` and its `data` (opened once, by the
        caller or here); `local`: the local tier's copies to consider (session.local_source)."""
        self.cfg, self.allow_config_change, self.local = cfg, allow_config_change, local
        self.world, self.rank = distributed.world(), distributed.rank()
        self.task = task if task is not None else load_task(cfg)
        self.device = process_device(cfg, self.world)
        self.data = data if data is not None else self.task.data(task_context(cfg, self.rank, self.world,
                                                                              self.device))
        self.iterator = is_iterator_source(self.data.train)
        self.restore_s = 0.0
        self._rejected: list[dict[str, Any]] = []
        self.source, self.persistent, self.verify = agree_on_checkpoint(store, cfg, resume)
        self.candidates = self._candidates()
        self._next = 0

    def _candidates(self) -> list[Candidate]:
        tried = [Candidate(self.source, ref, PERSISTENT) for ref in self.persistent]
        if self.local is None:
            return tried
        with self._timed():  # with several ranks the local copies are verified here, before agreeing
            own = self.local.choose(Coverage(global_data=not self.iterator))
        own_candidates = [] if own is None else [Candidate(own.store, own.ref, own.tier, own.owner, own.shards)]
        return sorted(own_candidates + tried, key=lambda c: -c.step)  # stable: local first at an equal step

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.restore_s += time.perf_counter() - t0

    def start(self) -> Started | None:
        """The trainer restored from the newest good checkpoint, or None when that is of a finished
        run (it says so on stderr). See the class docstring."""
        while True:
            choice = self.choose()
            if choice is None:
                return None
            # The disk reads the checkpoint while the trainer it loads into is built (prefetch.py).
            with self._prefetch(choice):
                t_build = time.perf_counter()
                trainer = Trainer(self.cfg, rank=self.rank, world_size=self.world, task=self.task, data=self.data,
                                  fresh=choice.candidate is None, saved_exact=choice.saved_exact)
                build_s = time.perf_counter() - t_build
                try:
                    resized = self.restore(trainer, choice)
                    changed = check_built(built_changes(trainer), self.cfg.run_dir, self.allow_config_change)
                except PassedOver:
                    trainer.close()  # partly loaded: the next choice gets a trainer of its own
                    continue
                except BaseException:
                    trainer.close()
                    raise
            return Started(trainer, choice, self.restore_s, resized, build_s, changed)

    @staticmethod
    def _prefetch(choice: Choice) -> contextlib.AbstractContextManager[object]:
        if choice.candidate is None or choice.checkpoint is None:
            return contextlib.nullcontext()
        return Prefetch(choice.candidate.store.loc, choice.candidate.ref, choice.checkpoint.tensor_files)

    def choose(self) -> Choice | None:
        """The next candidate to load (candidates already chosen are not offered again), a fresh
        start when none is left, or None for a finished run's last checkpoint (with `Verify.WHILE`
        verified first, since it is not loaded)."""
        while self._next < len(self.candidates):
            chosen = self.candidates[self._next]
            self._next += 1
            with self._timed():
                choice = self._consider(chosen)
            if choice is not False:
                return choice
        if self.persistent:
            raise all_damaged(self.cfg, self.persistent)
        return Choice(None)

    def _consider(self, chosen: Candidate) -> Choice | None | Literal[False]:
        """`chosen` opened and checked: its Choice, None (a finished run), or False (passed over)."""
        try:
            checkpoint = chosen.store.open(chosen.ref)
        except CheckpointCorrupt as e:
            if self.verify is not Verify.WHILE and chosen.owner is None:
                raise  # verified already: damaged since, which a person must look at
            self._pass_over(chosen, str(e))
            return False
        shard_copies: list[tuple[CheckpointStore, Checkpoint]] = []
        if chosen.owner is not None:
            assert self.local is not None  # a candidate with an owner is the local tier's
            # Every rank tries the same local candidate (agreed by `choose`): all load it or none.
            problem, shard_copies = _local_problem(self.local, chosen, checkpoint)
            if not distributed.all_ok(problem is None):
                if problem:
                    self._pass_over(chosen, problem)
                return False
        saved = checkpoint.state
        changes = check_compatible(saved["meta"], self.cfg, self.allow_config_change, self.data.identity,
                                   mode_decided=self.cfg.parallel.exact_elastic == AUTO)
        # Whether the run finished is the trainer part's (state.TrainerCounters), nowhere else.
        if saved["parts"]["trainer"]["finished"] and chosen.step >= self.cfg.train.steps:
            # Finished only if that checkpoint is whole: a damaged one is passed over like any
            # other, and the steps after the one before are trained again.
            problems = chosen.store.verify(chosen.ref) if self.verify is Verify.WHILE else []
            if problems:
                skipped(chosen.ref, problems)
                return False
            log.info("run already finished", step=chosen.step, run_dir=self.cfg.run_dir)
            print(f"run already finished at step {chosen.step}: {self.cfg.run_dir}", file=sys.stderr)
            return None
        return Choice(chosen, saved_mode(saved["meta"]), checkpoint, changes, tuple(shard_copies))

    def restore(self, trainer: Trainer, choice: Choice) -> WorldChange | None:
        """Load `choice`'s checkpoint into `trainer` (built for it); the world-size change since it.
        A local or peer copy was verified when chosen; a persistent one is verified while it loads
        (`Verify.WHILE`): found damaged, it is passed over (`PassedOver`)."""
        chosen = choice.candidate
        if chosen is None:
            return None
        assert choice.checkpoint is not None  # a candidate is chosen opened
        with self._timed():
            if trainer.sharded or choice.checkpoint.sharded:
                trainer.materialize_optimizer_state()  # read into live tensors of the right sharding
            local_copy = chosen.owner is not None
            try:
                load(chosen.store, choice.checkpoint, trainer.state.parts(),
                     verify=Verify.NO if local_copy else self.verify, kept_on_new_rank=trainer.state.kept_on_new_rank,
                     one_rank=local_copy, shard_copies=list(choice.shard_copies))
            except CheckpointCorrupt as e:
                if self.verify is not Verify.WHILE and not local_copy:
                    raise
                self._pass_over(chosen, str(e))
                raise PassedOver(str(e)) from e
            return after_load(choice.checkpoint.state, trainer.cfg, chosen.step, trainer.state.sharded,
                              shape=(trainer.batch_size, trainer.grad_accum))

    @property
    def rejected(self) -> list[dict[str, Any]]:
        """The local tier's copies passed over: by the tier's choice, then here."""
        return (self.local.rejected if self.local is not None else []) + self._rejected

    def _pass_over(self, chosen: Candidate, problem: str) -> None:
        skipped(chosen.ref, [problem])
        if chosen.owner is not None:
            self._rejected.append({"tier": chosen.tier, "step": chosen.step, "url": chosen.ref.url,
                                  "problem": problem[:300], "rank": self.rank})


def _local_problem(local: LocalRecovery, chosen: Candidate,
                   checkpoint: Checkpoint) -> tuple[str | None, list[tuple[CheckpointStore, Checkpoint]]]:
    """Why the local copy `chosen` (opened: `checkpoint`) or one of the copies it reads its shards
    from must not be loaded (None: all are good; the cached verification of `LocalRecovery.problem`,
    so only a copy moved in is read again), and those copies opened."""
    assert chosen.owner is not None  # a local copy
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
    `Resume`); a checkpoint given by URL was verified here already."""
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
    `mode_decided`: `parallel.exact_elastic` is "auto" in `cfg`: the run decides the mode
    (exact_mode.py), so a change of it is that decision's, logged there, not the user's."""
    changed = config_changes(meta["config"], cfg)
    if mode_decided:
        changed.pop("parallel.exact_elastic", None)
    changed.update(identity_changes(meta.get("data"), data_identity))
    if changed and not allow_config_change:
        raise UserError(f"the config changes the math of the run in {cfg.run_dir}: {', '.join(changed)} differ "
                        f"from the checkpoint (checkpoint -> now: {old_and_new(changed)}); restore them, use a new "
                        "--run-dir, or pass --allow-config-change")
    if changed:
        log.warning("resuming with a changed config; the new values apply from the first resumed step, bitwise "
                    "equality is not promised", changes={k: f"{a!r} -> {b!r}" for k, (a, b) in changed.items()})
    warn_if_changed(meta.get("environment", {}), distributed.resolve_device(cfg.train.device))
    return changed


def old_and_new(changes: dict[str, tuple[Any, Any]], width: int = 120) -> str:
    """`key old -> new, ...`, each value's repr at most `width` characters: a longer one keeps its
    two ends (where two paths or digests differ, as often as not)."""
    def short(value: Any) -> str:
        text = repr(value)
        half = (width - 3) // 2
        return text if len(text) <= width else f"{text[:half]}...{text[-half:]}"
    return ", ".join(f"{key} {short(old)} -> {short(new)}" for key, (old, new) in changes.items())


def built_changes(trainer: Trainer) -> dict[str, tuple[Any, Any]]:
    """What the trainer's optimizers and schedulers, as built from the config and the task's code,
    set otherwise than the checkpoint it loaded (`optim adamw/betas` -> (saved, built); the load
    put the built values in force: optim/bundle.py, optim/schedulers.py)."""
    return {f"{part} {key}": values for part, bundle in (("optim", trainer.optim), ("sched", trainer.sched))
            for key, values in bundle.hyperparameter_changes.items()}


def check_built(changes: dict[str, tuple[Any, Any]], run_dir: str,
                allow_config_change: bool) -> dict[str, tuple[Any, Any]]:
    """`changes` (`built_changes`) when `allow_config_change`, else UserError naming each with its
    two values: a setting the config or the task's code changed is never silently the checkpoint's
    nor silently the new one."""
    if changes and not allow_config_change:
        raise UserError(f"the optimizers built for the run in {run_dir} differ from the checkpoint's (checkpoint -> "
                        f"now: {old_and_new(changes)}); restore the config or task code they were built from, use a "
                        "new --run-dir, or pass --allow-config-change")
    if changes:
        log.warning("the optimizers are built otherwise than the checkpoint's; the built values apply from the first "
                    "resumed step", changes={k: f"{a!r} -> {b!r}" for k, (a, b) in changes.items()})
    return changes
