"""[parallel]: how a model is spread over the ranks (DDP or FSDP, the shard units, the gather
dtype) and whether a step is exact at every world size (`exact_elastic`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from harness.config.section import Section


class ParallelSection(Section):
    """How a model is spread over the ranks of a torchrun group (docs/distributed.md)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "With several ranks: \"ddp\" replicates the model and optimizer on every rank (DistributedDataParallel; "
            "rank 0 writes them); \"fsdp\" shards parameters, gradients and optimizer state over the ranks (FSDP2 "
            "fully_shard per block and on the root) and every rank writes its own shards "
            "(torch.distributed.checkpoint). One process has nothing to shard: it trains the whole model (a warning "
            "says so) and loads a sharded checkpoint all the same."
        ),
    )
    shard_modules: str = Field(
        r"(.*\.)?\d+",
        description=(
            "With fsdp: a regular expression; every module whose qualified name (model.named_modules()) matches it in "
            "full becomes its own FSDP unit (its parameters gathered for its forward/backward only), then the root "
            "takes the rest. The default matches the items of every ModuleList/Sequential (`h.0`, `blocks.11`): a "
            "transformer's blocks."
        ),
    )
    @field_validator("shard_modules")
    @classmethod
    def _a_regular_expression(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"{pattern!r} is not a regular expression ({e}); fix it, or unset it for the default"
            ) from None
        return pattern

    param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "With fsdp on CUDA: the dtype parameters are gathered and computed in (MixedPrecisionPolicy param_dtype); "
            "gradients are always reduced in fp32 and the sharded parameters and optimizer state stay fp32. Ignored on "
            "CPU (gloo), where fsdp computes in fp32 (a warning says so)."
        ),
    )
    exact_elastic: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Make every step independent of the world size, bit for bit (harness/parallel/exact.py; "
            "docs/distributed.md, \"Exact elastic\"): the step's train.global_batch samples are cut into V = "
            "global_batch / data.batch_size canonical micro-batches in sample order, rank r of W takes the "
            "contiguous block r*V/W..(r+1)*V/W-1, each micro-batch draws its random numbers from (seed, step, "
            "micro-batch), and the gradients are summed over one fixed tree of the V micro-batches. Needs "
            "train.global_batch and data.batch_size set (train.grad_accum unset: it is V / W), "
            "train.cpu_threads set on a CPU and a map-style dataset; DDP and FSDP alike; the exact world sizes are "
            "1 and every W dividing V with V / W a power of two. \"auto\" (the default): on wherever those hold, "
            "and a run keeps the mode it started in (harness/run/exact_mode.py; the log and the start event say "
            "which mode runs and why); true: refuse what they do not allow; false: off."
        ),
    )

