"""A resume at another world size (an elastic restart): what is derived anew, what continues.

Contract (docs/distributed.md, "Changing the world size"). It does not depend on the parallel
strategy: all it reads is the world size the checkpoint recorded (`WORLD_SIZE_KEY` in its meta;
none = one process) and the config, so a sharded strategy plugs in by recording the same key.
- The global batch is the config's: `config.batch_shape` derives the factor the config leaves
  unset (grad_accum, or batch_size) so micro-batch x grad_accum x world = train.global_batch, and
  refuses a world size with no integer split, naming the valid ones. `harness train` calls it
  before it takes the lease, so a refused world size writes nothing.
- The data cursor counts global samples (harness/data/order.py), and replicated state (model,
  optimizer, schedulers, counters) loads as saved: neither needs anything here.
- Random streams: at the saving run's world size every rank gets its own streams back (bitwise
  resume). At another one, every rank restarts its generators from (seed, resumed step, rank,
  new world size) (`reseed`): a pure function of the checkpoint and the new world size, the same
  for every rank layout the checkpoint came from. Dropout masks are drawn per rank over that
  rank's micro-batch, so they depend on the world size (deriving them from the global sample id
  would need every model's dropout to draw per sample). Under `parallel.exact_elastic` nothing
  is restarted: training draws only from per-micro-batch streams (harness/parallel/exact.py), so every
  rank's own streams are the run seed's at any world size, and the resumed run is the
  uninterrupted one bit for bit: its re-run steps are checked in full, but for the hashes of
  resharded parts (`fingerprint_checks`).
- Sharded parts (FSDP): a part sharded when saved or now is resharded by the load (DCP reads
  any layout into any other); `WorldChange.resharded` names them, because a rank's hash of such
  a part covers its own shard, so the restored-state check cannot compare it with the hash at
  save time (`fingerprint_checks`). Every other part is still checked.
- `WorldChange.event()`: the fields of the `world_size_changed` event (old/new world size, the
  batch shape at each, the global batch at each).
- Said on rank 0 (`world_change`): a change where the run and the checkpoint are both in exact
  elastic mode continues bit for bit (an info line saying so); any other warns that bitwise
  equality with an uninterrupted run is not promised.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from harness.checkpoint import WORLD_SIZE_KEY, sharded_parts
from harness.config import RunConfig, batch_shape
from harness.errors import UserError
from harness.log import get_logger
from harness.parallel import distributed
from harness.repro.rng import seed_everything
from harness.repro.splitmix import derive_seed
from harness.run.exact_mode import saved_mode

log = get_logger(__name__)

# derive_seed's first part for the streams a world-size change restarts: apart from every other
# use of the run seed (the rank streams of a fresh start, the data order).
_RESEED_DOMAIN = 0x454C4153  # "ELAS"


@dataclass(frozen=True)
class WorldChange:
    """A resume at `new_world` ranks from a checkpoint written at step `step` by `old_world`.
    `old_shape` / `new_shape`: (micro-batch, grad_accum) at each world size; `old_shape` is None
    when the current config cannot run at the old size (a config changed since, under
    --allow-config-change). `resharded`: the parts sharded in the checkpoint or in this run
    (module docstring); `exact`: the run is in exact elastic mode."""

    step: int
    old_world: int
    new_world: int
    old_shape: tuple[int, int] | None
    new_shape: tuple[int, int]
    resharded: frozenset[str] = frozenset()
    exact: bool = False  # parallel.exact_elastic: the step does not depend on the world size

    @property
    def global_batch(self) -> tuple[int | None, int]:
        """(old, new) samples per optimizer step; they differ only without train.global_batch."""
        old = self.old_shape[0] * self.old_shape[1] * self.old_world if self.old_shape else None
        return old, self.new_shape[0] * self.new_shape[1] * self.new_world

    def event(self) -> dict[str, Any]:
        old, new = self.global_batch
        return {"step": self.step, "old_world_size": self.old_world, "new_world_size": self.new_world,
                "old": _shape(self.old_shape, old), "new": _shape(self.new_shape, new)}


def _say(change: WorldChange, bitwise: bool) -> None:
    where = {"saved_world_size": change.old_world, "world_size": change.new_world, "step": change.step}
    if bitwise:
        log.info("resuming with a different world size in exact elastic mode: the run continues bit for bit as "
                 "the uninterrupted one would (docs/distributed.md, \"Exact elastic\")", **where)
    else:
        log.warning("resuming with a different world size: the data cursor is re-split (no sample of the epoch is "
                    "repeated or skipped), but bitwise equality with an uninterrupted run is not promised across "
                    "world sizes outside exact elastic mode (the start event's exact_elastic_why says why it is off)",
                    **where)


def _shape(shape: tuple[int, int] | None, global_batch: int | None) -> dict[str, int | None] | None:
    if shape is None:
        return None
    return {"batch_size": shape[0], "grad_accum": shape[1], "global_batch": global_batch}


def saved_world_size(meta: dict[str, Any]) -> int:
    """The world size that wrote a checkpoint (1 when its meta names none: one process)."""
    return int(meta.get(WORLD_SIZE_KEY, 1))


def world_change(meta: dict[str, Any], cfg: RunConfig, world: int, step: int, *,
                 shape: tuple[int, int]) -> WorldChange | None:
    """The change from the checkpoint's world size (its `meta`) to `world`, where the run trains
    with batch `shape` (the trainer's), or None when equal; said on rank 0 (module docstring)."""
    old = saved_world_size(meta)
    if old == world:
        return None
    try:
        old_shape = batch_shape(cfg, old)
    except UserError:
        old_shape = None
    change = WorldChange(step, old, world, old_shape, shape, exact=cfg.parallel.exact_elastic is True)
    if distributed.rank() == 0:
        _say(change, bitwise=change.exact and saved_mode(meta))
    before, after = change.global_batch
    if before is not None and before != after:
        log.warning("train.global_batch is not set, so the global batch changes with the world size; set it to "
                    "keep the sequence of global batches (docs/distributed.md)", step=step, old_global_batch=before,
                    new_global_batch=after)
    return change


def reseed(change: WorldChange, seed: int, rank: int) -> None:
    """Restart this rank's random streams for the new world size (module docstring)."""
    seed_everything(derive_seed(_RESEED_DOMAIN, seed, change.step, rank, change.new_world))


def after_load(saved: dict[str, Any], cfg: RunConfig, step: int, sharded: Collection[str], *,
               shape: tuple[int, int]) -> WorldChange | None:
    """On every rank, right after a checkpoint (its parsed state.json `saved`, written at `step`)
    was loaded into the live parts, by a resume or a rollback (`sharded`: the parts this run
    shards, `shape`: the batch shape it trains with): the world-size change since it, with this
    rank's random streams restarted for the new world size; None (and nothing done) at the same
    size."""
    change = world_change(saved["meta"], cfg, distributed.world(), step, shape=shape)
    if change is not None:
        change = replace(change, resharded=sharded_parts(saved["parts"]) | frozenset(sharded))
        if not change.exact:
            reseed(change, cfg.train.seed, distributed.rank())
    return change


def fingerprint_checks(change: WorldChange | None) -> dict[str, Any]:
    """The arguments of `FingerprintLog.watch` after loading across `change`: at another world
    size a re-run step must see the same batch and lr, not the same bits (the reduction order
    changed), the restarted random streams are not the saved ones, and a resharded part's hash
    covers another share of it than the one hashed at save time. In exact elastic mode only the
    last holds: every re-run step's loss and state are checked, but for the resharded parts."""
    if change is None:
        return {}
    if change.exact:
        return {"unchecked": tuple(sorted(change.resharded))}
    return {"inputs_only": True, "unchecked": ("rng", *sorted(change.resharded))}
