"""Which device a training process runs on (`train.device`), and how its step is compiled there
(`train.compile`)."""

from __future__ import annotations

from typing import Any

import torch

from harness.config import RunConfig
from harness.parallel import distributed


def process_device(cfg: RunConfig, world_size: int) -> torch.device:
    """`train.device` of this process; in a group on CUDA, this rank's own device."""
    device = distributed.resolve_device(cfg.train.device)
    if device.type == "cuda" and world_size > 1:
        return torch.device("cuda", torch.cuda.current_device())  # LOCAL_RANK's, set by the process group
    return device


def compile_options(device: torch.device) -> dict[str, Any] | None:
    """Inductor options for `train.compile` on `device`. On a CPU, dropout keeps ATen's random
    number kernels (`fallback_random`): inductor's own kernels draw each element's number inside
    their generated C++ loops, which made the quickstart's compiled step 1.23-1.42x the eager
    one's CPU time on the 2-core machine, against 1.02x with ATen's (0.96x without dropout;
    docs/bench-overhead.md). On a GPU inductor's random numbers (philox, in its Triton kernels)
    are the fast ones: torch's defaults stay. Either way the numbers come from torch's
    generators, which the `rng` part saves, so a compiled run resumes bitwise."""
    return {"fallback_random": True} if device.type == "cpu" else None
