"""FSDP2: sharding a model over the ranks of the process group (`parallel.strategy = "fsdp"`).

The rule (docs/distributed.md): every module whose qualified name matches
`parallel.shard_modules` in full (default: the items of every ModuleList/Sequential, `h.0`,
`blocks.11`, i.e. a transformer's blocks) becomes its own `fully_shard` unit, deepest first,
then the root takes the parameters left (embeddings, final norm, head). Each unit's parameters
are all-gathered for its forward and backward only, and its gradients reduce-scattered, so a
rank holds 1/world of the parameters, gradients and optimizer state between steps. Parameter
names do not change (FSDP2 swaps parameters for DTensors in place), so optimizer bundles,
checkpoints and fingerprints keep their names.

On CUDA `parallel.param_dtype = "bf16"` gathers and computes in bfloat16 and reduces gradients
in float32 (`MixedPrecisionPolicy`); the sharded parameters and optimizer state stay float32.
On CPU (gloo: the tests) the policy is not applied.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from harness.config import ParallelSection
from harness.errors import UserError
from harness.log import get_logger
from optim.dtensor import is_dtensor

log = get_logger(__name__)


def shard_units(model: torch.nn.Module, pattern: str) -> list[str]:
    """The qualified names of the modules `pattern` matches in full, deepest first."""
    rule = re.compile(pattern)  # checked by the config
    names = [name for name, _ in model.named_modules() if name and rule.fullmatch(name)]
    return sorted(names, key=lambda n: -n.count("."))


def shard_model(model: torch.nn.Module, cfg: ParallelSection, device: torch.device, world_size: int) -> list[str]:
    """Apply `fully_shard` to `model` in place (see the module docstring); returns the units.
    Collective: every rank calls it with the same model. A `shard_modules` the user set that
    matches nothing is a UserError (the default may match nothing: then only the root is one)."""
    units = shard_units(model, cfg.shard_modules)
    if not units and "shard_modules" in cfg.model_fields_set:
        raise UserError(f"parallel.shard_modules = {cfg.shard_modules!r} matches no module of the model; "
                        f"pick names from model.named_modules() (e.g. 'h\\.\\d+'), or unset it")
    # Imported here: FSDP loads DTensor, which costs a second at every start (optim/dtensor.py).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not units:
        log.warning("parallel.shard_modules matches no module: the whole model is one FSDP unit (every parameter "
                    "gathered for the whole forward)", pattern=cfg.shard_modules)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy()
    if cfg.param_dtype == "bf16":
        if device.type == "cuda":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            log.warning("parallel.param_dtype = 'bf16' applies on CUDA only; this CPU run computes in fp32")
    modules = dict(model.named_modules())
    for name in units:
        fully_shard(modules[name], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    log.info("model sharded with FSDP2", units=len(units), world_size=world_size, param_dtype=cfg.param_dtype)
    return units


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP unit of `model` back on its sharded parameters. A forward without a backward
    (an evaluation, exact elastic mode's probe) leaves the root unit's parameters unsharded,
    registered in the module as plain tensors, until something reshards them: exact elastic
    mode, which reads the sharded parameters (`model.parameters()`) before the next forward,
    and a checkpoint loaded into them need them sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def holds_dtensors(part: Any) -> bool:
    """Whether a state part (a module, or an object with `state_dict`) holds sharded tensors (a
    task's EMA of FSDP's parameters): then every rank writes its own shards of it, as of the model."""
    tensors = part.parameters() if isinstance(part, torch.nn.Module) else part.state_dict().values()
    return any(is_dtensor(t) for t in tensors)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A scalar result of sharded math (a DTensor) as a plain tensor; collective for DTensors."""
    return t.full_tensor() if is_dtensor(t) else t


def materialize_optimizer_state(optimizers: dict[str, torch.optim.Optimizer]) -> None:
    """Create every optimizer's per-parameter state now, with its parameter's placement, as
    torch.distributed.checkpoint.state_dict does before a load (one step on zero gradients at
    lr 0, which leaves the parameters bitwise as they were for AdamW/SGD): a sharded checkpoint
    is read into live tensors, so they must exist before the load."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for opt in optimizers.values():
        _init_optim_state(opt)
