"""The environment a run computes in, recorded in run.json and in every checkpoint's meta: exact
resume is promised under the same one, and a resume under another is warned about."""

from __future__ import annotations

from typing import Any

import torch

from harness.log import get_logger
from harness.repro import numerics

log = get_logger(__name__)

# What changes the bits of a step between a checkpoint and its resume, where both record it: the
# GPU model (its kernels and their reduction orders), the CUDA, cuDNN and NCCL versions.
_COMPARED = ("torch", "device_type", "gpu", "cuda", "cudnn", "nccl")


def environment_fingerprint(device: torch.device) -> dict[str, Any]:
    """What exact resume is promised for: library versions, the device type (on a GPU its model and
    the CUDA, cuDNN and NCCL versions) and the numerical reproducibility settings in force
    (harness.repro.numerics)."""
    import platform

    import safetensors

    fp: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                          "safetensors": safetensors.__version__, "device_type": device.type,
                          "numerics": numerics.settings()}
    if device.type == "cuda":
        fp["cuda"] = torch.version.cuda
        fp["gpu"] = torch.cuda.get_device_name(device)
        fp["cudnn"] = torch.backends.cudnn.version()
        if torch.distributed.is_nccl_available():
            fp["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return fp


def environment_changes(before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, current value) for each compared key both recorded and that differs:
    `_COMPARED`, the resume-sensitive numerics, and on a GPU on both sides each CUDA numerical
    setting (TF32, reduced-precision reductions, cuDNN, attention backends, NCCL's algorithm, the
    cuBLAS workspace)."""
    differ = [(key, before[key], now[key]) for key in _COMPARED if key in before and key in now
              and before[key] != now[key]]
    then_numerics, now_numerics = before.get("numerics", {}), now.get("numerics", {})
    differ += [(f"numerics.{key}", then_numerics[key], now_numerics[key]) for key in numerics.RESUME_SENSITIVE
               if key in then_numerics and key in now_numerics and then_numerics[key] != now_numerics[key]]
    if before.get("device_type") == now.get("device_type") == "cuda":
        then_cuda = {**then_numerics.get("cuda", {}), **_cublas(then_numerics)}
        now_cuda = {**now_numerics.get("cuda", {}), **_cublas(now_numerics)}
        differ += [(f"numerics.cuda.{key}", then_cuda.get(key), now_cuda.get(key))
                   for key in sorted(then_cuda.keys() | now_cuda.keys()) if then_cuda.get(key) != now_cuda.get(key)]
    return differ


def _cublas(recorded: dict[str, Any]) -> dict[str, Any]:
    """cuBLAS's workspace setting as recorded (its reductions are split by it)."""
    env = recorded.get("env", {})
    return {"CUBLAS_WORKSPACE_CONFIG": env["CUBLAS_WORKSPACE_CONFIG"]} if "CUBLAS_WORKSPACE_CONFIG" in env else {}


def warn_if_changed(before: dict[str, Any], device: torch.device) -> None:
    """Warn about each difference (`environment_changes`) between the environment a checkpoint
    recorded (`before`) and this one."""
    for key, then, current in environment_changes(before, environment_fingerprint(device)):
        log.warning("resuming on a different environment; bitwise equality is not promised there",
                    key=key, checkpoint=then, now=current)
