"""Whether a run trains in exact elastic mode (`parallel.exact_elastic`, harness/parallel/exact.py),
and why: `decide`, then `with_mode` for the config the run trains with.

`true` and `false` are what they say (`true` refuses a config or a world size it cannot be exact
for: config.exact_shape, and the trainer on a CPU without a thread count). `"auto"`, the default,
is the mode wherever its preconditions hold, and names the first that fails otherwise:
- train.global_batch and data.batch_size set, train.grad_accum unset (it is derived), the global
  batch a whole number of micro-batches;
- the world size exact for them (config.exact_world_sizes: 1, and W with V / W a power of two);
- on a CPU, train.cpu_threads set (kernels must see the same thread count at every world size);
- a map-style dataset (the harness cuts the canonical micro-batches; a user's iterator cannot);
- no buffer updated by the model's forward (batch-norm statistics, an EMA or a counter kept as a
  buffer): each rank would update its own copy over its own micro-batches, which no exact
  cross-rank reduction makes the same at every world size. Judged from what the forward does, by
  one probe forward of the first micro-batch watched at the trainer's start
  (`repro.buffer_probe.updated_buffers`, `with_buffers` here): `true` is refused naming the
  buffers, "auto" turns the mode off naming them;
- a resume keeps the mode of the checkpoint it loads when it was off: a run started without it
  stays without it, since its steps so far were not exact ones and switching would change the
  math mid-run. A run started in it goes on in it where the preconditions hold, and without it
  (said in the log and the `start` event) where one fails, e.g. at a world size that is not exact.
The decision is a bool in the config the run trains with (`with_mode`), which its checkpoints
record, so a copy of the local tier says which mode wrote it (checkpoint/save/coverage.py).
"""

from __future__ import annotations

from typing import Any

from harness.config import RunConfig, exact_world_sizes
from harness.errors import UserError

AUTO = "auto"
NAMED = 6  # buffers named in a decision's why; the log line of the decision names them all


def saved_mode(meta: dict[str, Any]) -> bool:
    """The mode a checkpoint (its meta) was trained in."""
    return meta.get("config", {}).get("parallel", {}).get("exact_elastic") is True


def decide(cfg: RunConfig, world: int, device_type: str, iterator_data: bool,
           saved: bool | None = None) -> tuple[bool, str]:
    """(exact elastic on, why) for `cfg` at `world` ranks on `device_type`, with a user's iterator
    as the training data or not; `saved`: the mode of the checkpoint resumed from (None: a fresh
    start). See the module docstring."""
    setting = cfg.parallel.exact_elastic
    if setting is not AUTO:
        return bool(setting), f"parallel.exact_elastic = {str(setting).lower()}"
    why_not = _precondition_failed(cfg, world, device_type, iterator_data)
    if why_not is None and saved is False:
        why_not = "the checkpoint resumed from was trained without it (a run keeps its mode)"
    if why_not is not None:
        return False, f"auto: off, {why_not}"
    return True, "auto: every precondition holds"


def _precondition_failed(cfg: RunConfig, world: int, device_type: str, iterator_data: bool) -> str | None:
    target, batch_size = cfg.train.global_batch, cfg.data.batch_size
    if target is None:
        return "train.global_batch is not set"
    if "batch_size" not in cfg.data.model_fields_set:
        return "data.batch_size is not set (the canonical micro-batch)"
    if "grad_accum" in cfg.train.model_fields_set:
        return "train.grad_accum is set (the mode derives it)"
    if target % batch_size:
        return f"train.global_batch = {target} is not a whole number of micro-batches of {batch_size}"
    exact = exact_world_sizes(target // batch_size)
    if world not in exact:
        return f"world size {world} is not exact for {target // batch_size} micro-batches (exact: {exact})"
    if device_type == "cpu" and cfg.train.cpu_threads is None:
        return "train.cpu_threads is not set on a CPU"
    if iterator_data:
        return "the training data is a data.factory iterator"
    return None


def with_buffers(setting: bool | str, decision: tuple[bool, str], updated: list[str]) -> tuple[bool, str]:
    """`decision` (from `decide`) once a probe forward found the model's forward updating the
    buffers `updated` (as "PART.NAME"): unchanged where the mode is off or none is updated; with
    the user's `setting` (`parallel.exact_elastic`) true refused in one line naming them; "auto":
    off, naming them."""
    exact, _ = decision
    if not exact or not updated:
        return decision
    names = ", ".join(updated[:NAMED]) + (f" and {len(updated) - NAMED} more" if len(updated) > NAMED else "")
    why = (f"the model's forward updates buffer{'s' if len(updated) > 1 else ''} {names}, which each rank would "
           "update over its own micro-batches (no exact cross-rank reduction)")
    if setting is True:
        raise UserError(f"parallel.exact_elastic = true, but {why}; set parallel.exact_elastic = false (or \"auto\", "
                        "which trains without it)")
    return False, f"auto: off, {why}"


def exact_at_every(cfg: RunConfig, worlds: list[int]) -> bool:
    """Whether a run of `cfg` trains in exact elastic mode at each of `worlds` (a check across
    world sizes, harness/verify/world_equivalence.py). Torch-free: the device is taken as a CPU
    unless `train.device` names CUDA, so an "auto" device on a GPU may be judged inexact (a looser
    default tolerance, never a stricter one)."""
    device = "cuda" if cfg.train.device == "cuda" else "cpu"
    return all(decide(cfg, world, device, iterator_data=False)[0] for world in worlds)


def with_mode(cfg: RunConfig, exact: bool) -> RunConfig:
    """`cfg` with `parallel.exact_elastic` decided (a bool)."""
    if cfg.parallel.exact_elastic is exact:
        return cfg
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"exact_elastic": exact})})
