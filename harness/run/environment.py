"""The environment a run computes in, recorded in run.json and in every checkpoint's meta: exact
resume is promised under the same one, and a resume under another is warned about."""

from __future__ import annotations

from typing import Any

import torch

from harness.log import get_logger
from harness.repro import numerics

log = get_logger(__name__)


def environment_fingerprint(device: torch.device) -> dict[str, Any]:
    """What exact resume is promised for: library versions, the device type and the numerical
    reproducibility settings in force (harness.repro.numerics)."""
    import platform

    import safetensors

    fp: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                          "safetensors": safetensors.__version__, "device_type": device.type,
                          "numerics": numerics.settings()}
    if device.type == "cuda":
        fp["cuda"] = torch.version.cuda
        fp["gpu"] = torch.cuda.get_device_name(device)
    return fp


def warn_if_changed(before: dict[str, Any], device: torch.device) -> None:
    """Warn about each key (torch version, device type, resume-sensitive numerics) that differs
    between the environment a checkpoint recorded (`before`) and this one."""
    now = environment_fingerprint(device)
    differ: list[tuple[str, Any, Any]] = [(key, before[key], now[key]) for key in ("torch", "device_type")
                                          if key in before and before[key] != now[key]]
    saved_numerics = before.get("numerics", {})
    differ += [(f"numerics.{key}", saved_numerics[key], now["numerics"][key])
               for key in numerics.RESUME_SENSITIVE
               if key in saved_numerics and saved_numerics[key] != now["numerics"][key]]
    for key, then, current in differ:
        log.warning("resuming on a different environment; bitwise equality is not promised there",
                    key=key, checkpoint=then, now=current)
