"""The batch shape: (data.batch_size, train.grad_accum) at a world size, derived from
`train.global_batch` where the config leaves a factor unset, or from the exact elastic split; the
world sizes a config allows. A shape that cannot be is a UserError saying what to change."""

from __future__ import annotations

import math

from harness.config.run import RunConfig
from harness.errors import UserError


def batch_shape(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data.batch_size, train.grad_accum) for `world_size` ranks. With `train.global_batch` set,
    the one of the two the config leaves unset is derived (grad_accum when both are unset);
    raises UserError when global_batch != batch_size x grad_accum x world_size, saying which
    factors the config gave and what to change."""
    if cfg.parallel.exact_elastic is True:  # "auto" is decided by the run (harness/run/exact_mode.py)
        return exact_shape(cfg, world_size)
    batch_size, accum, target = cfg.data.batch_size, cfg.train.grad_accum, cfg.train.global_batch
    if target is None:
        return batch_size, accum
    accum_set = "grad_accum" in cfg.train.model_fields_set
    batch_set = "batch_size" in cfg.data.model_fields_set
    if not (accum_set and batch_set):  # derive the unset factor (grad_accum when both are unset)
        fixed, value, derived = (("data.batch_size", batch_size, "train.grad_accum") if not accum_set
                                 else ("train.grad_accum", accum, "data.batch_size"))
        per_step = value * world_size
        if target % per_step == 0:
            return (batch_size, target // per_step) if not accum_set else (target // per_step, accum)
        given = f"{fixed} = {value}{'' if accum_set or batch_set else ' (its default)'}"
        problem = f"{derived} (not set, so derived) would be {target} / ({value} x {world_size}), not a whole number"
        fix = f"make global_batch a multiple of {fixed} x world size ({per_step}), or change {fixed}"
    elif batch_size * accum * world_size == target:
        return batch_size, accum
    else:
        given = f"data.batch_size = {batch_size} and train.grad_accum = {accum}"
        problem = f"{batch_size} x {accum} x world size {world_size} is {batch_size * accum * world_size}"
        fix = (f"make global_batch {batch_size * accum} x the world size, or unset one of data.batch_size / "
               "train.grad_accum so it is derived (remove it from the config, or "
               '--set train.grad_accum=null; an inherited one: unset = ["train.grad_accum"] in the extending file)')
    valid = valid_world_sizes(cfg)
    where = (f"the valid world sizes for this config are {_listed(valid)}: run at one of those, or" if valid
             else "no world size splits it:")
    raise UserError(f"train.global_batch = {target} does not split over {world_size} rank(s) with {given}: "
                    f"{problem}; {where} {fix}")


def exact_shape(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data.batch_size, grad_accum) of `parallel.exact_elastic` at `world_size`: the canonical
    micro-batch is the config's data.batch_size, V = global_batch / batch_size of them make a
    step, and a rank accumulates its block of V / world_size. Raises UserError, naming the key to
    change, when the config leaves the micro-batch derived (or fixes grad_accum), when the global
    batch is no whole number of micro-batches, or when `world_size` is not exact for V
    (`exact_world_sizes`)."""
    target, batch_size = cfg.train.global_batch, cfg.data.batch_size
    if target is None or "batch_size" not in cfg.data.model_fields_set:
        raise UserError("parallel.exact_elastic needs train.global_batch and data.batch_size set (the canonical "
                        "micro-batch, the same at every world size): set both")
    if "grad_accum" in cfg.train.model_fields_set:
        raise UserError(f"parallel.exact_elastic derives train.grad_accum (global_batch / batch_size / world size), "
                        f"but the config sets it to {cfg.train.grad_accum}: unset it (--set train.grad_accum=null)")
    if target % batch_size:
        raise UserError(f"parallel.exact_elastic: train.global_batch = {target} is not a whole number of micro-batches "
                        f"of data.batch_size = {batch_size}; make it a multiple of {batch_size}")
    micro_batches = target // batch_size
    exact = exact_world_sizes(micro_batches)
    if world_size not in exact:
        raise UserError(f"parallel.exact_elastic: world size {world_size} is not exact for {micro_batches} "
                        f"micro-batches per step (each rank's block must be a subtree of the summation tree); "
                        f"the exact world sizes are {_listed(exact)}: run at one of those")
    return batch_size, micro_batches // world_size


def exact_world_sizes(micro_batches: int) -> list[int]:
    """The world sizes at which `parallel.exact_elastic` is exact for V = `micro_batches`: 1 (one
    rank sums the whole tree), and every W dividing V whose block V / W is a power of two (a block
    is then one aligned subtree of the binary-counter tree, harness/parallel/exact.py)."""
    return [w for w in range(1, micro_batches + 1)
            if w == 1 or (micro_batches % w == 0 and (micro_batches // w) & (micro_batches // w - 1) == 0)]


def valid_world_sizes(cfg: RunConfig) -> list[int]:
    """Every world size `batch_shape` accepts for `cfg` (with `train.global_batch` set: the
    divisors of the global batch that leave an integer micro-batch x accumulation split)."""
    target = cfg.train.global_batch
    if target is None:
        return []  # any world size: the global batch grows with it
    divisors = {w for d in range(1, math.isqrt(target) + 1) if target % d == 0 for w in (d, target // d)}
    return sorted(w for w in divisors if _split_exists(cfg, target, w))


def _split_exists(cfg: RunConfig, target: int, world: int) -> bool:
    """Whether global_batch = batch_size x grad_accum x `world` has an integer solution with the
    factors the config sets held fixed (as `batch_shape` derives the other)."""
    accum_set = "grad_accum" in cfg.train.model_fields_set
    batch_set = "batch_size" in cfg.data.model_fields_set
    per_rank = target // world
    if not accum_set:
        return per_rank % cfg.data.batch_size == 0
    if not batch_set:
        return per_rank % cfg.train.grad_accum == 0
    return per_rank == cfg.data.batch_size * cfg.train.grad_accum


def _listed(sizes: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, sizes[:most]))
    return shown if len(sizes) <= most else f"{shown}, ... ({len(sizes)} sizes)"

