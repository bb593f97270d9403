"""Which checkpoint a training process starts from, and loading it into a new `Trainer`.

`choose_checkpoint` turns `--resume auto|never|CKPT_URL` into candidates; `agree_on_checkpoint`
makes every rank of a group load the one rank 0 verified; `resume_newest` tries the candidates
newest first, verifying each while it loads, and refuses (`all_damaged`) a run dir whose every
checkpoint is damaged. With a local tier (`LocalSource`, checkpoint/save/local_tier.py) its checkpoints join
the candidates by step (local first at an equal step: it reads faster); each is verified in full
and checked to be this run's and this rank's *before* it is loaded, and one that is not is
skipped, logged and recorded in `LocalSource.rejected` (the caller emits `checkpoint_rejected`
events). With several ranks every rank verifies its own local checkpoints and one all-gather of
the steps each verified gives the newest step every rank holds (`LocalSource.agreed`); with peer
copies, the newest step every rank's part is held of, its missing parts moved from the peers
(checkpoint/save/peer_recovery.py); else the persistent checkpoint rank 0 chose.
`check_compatible` refuses a changed math key or other data unless
`--allow-config-change`, and warns about another environment.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from harness.checkpoint import (
    LOCAL,
    PERSISTENT,
    CheckpointCorrupt,
    CheckpointRef,
    CheckpointStore,
    PeerHoldings,
    Verify,
    load,
    locate,
    not_mine,
    skipped,
)
from harness.config import RunConfig, config_changes
from harness.data.sources import identity_changes, open_data
from harness.errors import UserError
from harness.log import get_logger
from harness.parallel import distributed
from harness.run.elastic import WorldChange, after_load
from harness.run.environment import warn_if_changed
from harness.run.trainer import Trainer, resolve_device
from harness.storage.location import folder_name

log = get_logger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to resume from: its store, its ref, and the tier it is in (`LOCAL`/`PERSISTENT`)."""

    store: CheckpointStore
    ref: CheckpointRef
    tier: str

    @property
    def step(self) -> int:
        return self.ref.step


@dataclass
class LocalSource:
    """This rank's local tier of the run `run_id` as a source of checkpoints to resume from;
    `rejected` collects one record (tier, step, url, problem) per local checkpoint passed over.
    `peers`: the peer copies this rank holds (with several ranks and peer copies); `tier`: the
    tier its candidates are reported as (`PEER` once a rank's part came from a peer copy)."""

    store: CheckpointStore
    run_id: str
    peers: PeerHoldings | None = None
    tier: str = LOCAL
    rejected: list[dict[str, Any]] = field(default_factory=list)
    verified: set[int] = field(default_factory=set)

    def problems(self, ref: CheckpointRef, state: dict[str, Any]) -> list[str]:
        """Why the local checkpoint `ref` (its state.json `state` already read) must not be loaded
        here (`not_mine`), else every file that does not match its manifest (reads every byte, once
        per step). Empty when good."""
        other = not_mine(state, self.run_id, distributed.rank(), distributed.world())
        if other:
            return [other]
        problems = [] if ref.step in self.verified else self.store.verify(ref)
        if not problems:
            self.verified.add(ref.step)
        return problems

    def candidates(self) -> list[CheckpointRef]:
        """The local checkpoints to try, newest first: all of them with one process; with several
        ranks the newest step that every rank verified (`agreed`), or none."""
        if not distributed.is_distributed():
            return self.store.candidates()
        step = self.agreed()
        return [] if step is None else [self.store.ref(step)]

    def agreed(self) -> int | None:
        """The newest step every rank holds a good local checkpoint of (a collective: every rank
        calls it). Each rank verifies its own (damaged ones are rejected) and its peer copies, then
        one all-gather of (its good steps, its good peer copies, its rejections); `rejected` then
        holds every rank's, each with its rank. With peer copies, the newest step whose every
        rank's part some rank holds (`PeerHoldings.assemble`)."""
        good = []
        for ref in self.store.candidates():
            try:
                problems = self.problems(ref, self.store.open(ref).state)
            except CheckpointCorrupt as e:
                problems = [str(e)]
            if problems:
                self.reject(ref, problems)
            else:
                good.append(ref.step)
        held, rejected = self.peers.verified() if self.peers else ([], [])
        # Every rank's rejections travel with its steps: rank 0 alone writes the events.
        gathered = distributed.all_gather_object((good, held, self.rejected + rejected))
        self.rejected = [{**r, "rank": rank} for rank, (_, _, rejected) in enumerate(gathered) for r in rejected]
        if self.peers is None:
            return max(set.intersection(*(set(steps) for steps, _, _ in gathered)), default=None)
        step, self.tier = self.peers.assemble(self.store, [(steps, held) for steps, held, _ in gathered])
        return step

    def reject(self, ref: CheckpointRef, problems: list[str]) -> None:
        skipped(ref, problems)
        self.rejected.append({"tier": LOCAL, "step": ref.step, "url": ref.url, "problem": problems[0][:300]})


def resume_newest(cfg: RunConfig, source: CheckpointStore, candidates: list[CheckpointRef], verify: Verify,
                  allow_config_change: bool, local: LocalSource | None = None
                  ) -> tuple[Trainer, Candidate | None, float, dict, WorldChange | None] | None:
    """(trainer, the checkpoint it was restored from or None for a fresh start, seconds spent
    reading, loading and verifying checkpoints, the config changes since that checkpoint as
    `config_changes` gives them, the world-size change since it or None), or None when the
    newest good checkpoint is of a finished run (it says so on stderr; with `Verify.WHILE` that
    checkpoint is verified first, since it is not loaded). At another world size than
    the checkpoint's, every rank's random streams are restarted (harness/run/elastic.py).

    `local`: a local tier whose checkpoints are tried too, newest step first across both tiers
    (module docstring); none of them is loaded before it is found whole and this run's.

    `candidates` are tried newest first, each read once (`source.open`: manifest and state.json)
    and passed down. With `Verify.WHILE` each is hashed as it loads (one read of every byte); one
    found damaged (`CheckpointCorrupt`) is logged and skipped, and the trainer is built anew for
    the next, since the damaged one was already partly streamed into it. A checkpoint that is
    intact but does not fit (another model width) is an error, never skipped."""
    restore_s = 0.0
    # Read once: every candidate is checked against it.
    data = open_data(cfg.data, cfg.train.seed, distributed.rank(), distributed.world())
    tried = [Candidate(source, ref, PERSISTENT) for ref in candidates]
    if local is not None:
        t0 = time.perf_counter()  # with several ranks the local copies are verified here, before agreeing
        tried = sorted([Candidate(local.store, ref, local.tier) for ref in local.candidates()] + tried,
                       key=lambda c: -c.step)  # stable: local first at an equal step
        restore_s += time.perf_counter() - t0
    for chosen in tried:
        source, ref = chosen.store, chosen.ref
        t0 = time.perf_counter()
        trainer = None
        try:
            checkpoint = source.open(ref)
            saved = checkpoint.state
            if chosen.tier != PERSISTENT:
                problems = local.problems(ref, saved)
                if problems:
                    local.reject(ref, problems)
                    restore_s += time.perf_counter() - t0
                    continue
            changes = check_compatible(saved["meta"], cfg, allow_config_change, data.identity)
            # Whether the run finished is the trainer part's (state.TrainerCounters), nowhere else.
            if saved["parts"]["trainer"]["finished"] and ref.step >= cfg.train.steps:
                # Finished only if that checkpoint is whole: a damaged one is passed over like any
                # other, and the steps after the one before are trained again.
                problems = source.verify(ref) if verify is Verify.WHILE else []
                if problems:
                    skipped(ref, problems)
                    restore_s += time.perf_counter() - t0
                    continue
                log.info("run already finished", step=ref.step, run_dir=cfg.run_dir)
                print(f"run already finished at step {ref.step}: {cfg.run_dir}", file=sys.stderr)
                return None
            restore_s += time.perf_counter() - t0
            trainer = Trainer(cfg, rank=distributed.rank(), world_size=distributed.world(), data=data)
            t0 = time.perf_counter()
            if trainer.sharded or checkpoint.sharded:
                trainer.materialize_optimizer_state()  # read into live tensors of the right sharding
            # A local or peer checkpoint was verified above, and is this rank's own copy.
            load(source, checkpoint, trainer.state.parts(), verify=Verify.NO if chosen.tier != PERSISTENT else verify,
                 kept_on_new_rank=trainer.state.kept_on_new_rank)
            resized = after_load(saved, cfg, ref.step, trainer.state.sharded)
            return trainer, chosen, restore_s + time.perf_counter() - t0, changes, resized
        except BaseException as e:
            if trainer is not None:
                trainer.close()
            if not isinstance(e, CheckpointCorrupt) or (verify is not Verify.WHILE and chosen.tier == PERSISTENT):
                raise  # an intact checkpoint that does not fit: the error is about the setup
            if chosen.tier != PERSISTENT:
                local.reject(ref, [str(e)])
            else:
                skipped(ref, [str(e)])
            restore_s += time.perf_counter() - t0
    if candidates:
        raise all_damaged(cfg, candidates)
    return Trainer(cfg, rank=distributed.rank(), world_size=distributed.world(), data=data, fresh=True), None, \
        restore_s, {}, None


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
    warn_if_changed(meta.get("environment", {}), resolve_device(cfg.train.device))
    return changed
