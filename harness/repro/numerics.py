"""Numerical reproducibility: what the math libraries need to give the same bits run to run, set
by the harness itself (not the user's shell) and recorded with the run.

Why: torch's CPU build computes matrix products with Intel oneMKL, whose default mode ("CNR
off") promises nothing from one run to the next: it may pick code paths by the alignment of its
buffers and adjust its threads at run time ("MKL_DYNAMIC"). Two identical `harness train` runs
on a busy 2-core machine differed from step 2 on in 2 of 28 trials that way.
Conditional Numerical Reproducibility in strict mode ("AUTO,STRICT") makes ?gemm bitwise
repeatable whatever the alignment and even across thread counts; the other MKL routines and
torch's own parallel kernels split work by the thread count, so that count is fixed and recorded.
On CUDA the same job falls to deterministic algorithms, a fixed cuBLAS workspace and cuDNN
without autotuning (see `settings()` for what is recorded).

Contract:
- `prepare_environment()` runs first in the CLI, before torch is imported: it puts
  `REPRODUCIBLE_ENV` into `os.environ` where the user has not set those names, so they hold for
  this process's libraries (OpenMP reads them when it loads) and for every child process (data
  loader workers, supervised children).
- `apply(threads)` runs when a trainer is built: fixes torch's intra-op thread count (`threads`,
  or the count torch chose for this machine), switches MKL to strict CNR through its service API
  when it is not on yet, turns MKL's dynamic threads off, and enables deterministic algorithms.
  MKL's mode can only change before its first computation; when that has passed, one warning
  names the cause and the fix. Returns `settings()`.
- `settings()` is what is in force: recorded in run.json and in every checkpoint's environment.
  A resume under different `RESUME_SENSITIVE` settings warns (bitwise equality is not promised
  there), as a different torch version does.
- `warn_of_open_residual(device_type)`: where a residual nondeterminism is known on this platform
  and not yet explained (`open_residual`), one warning at the trainer's start names it and the
  setting that avoids it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

REPRODUCIBLE_ENV = {
    "MKL_CBWR": "AUTO,STRICT",
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    # cuBLAS picks reduction splits by workspace; a fixed one makes its GEMMs repeatable.
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}

CPUINFO = Path("/proc/cpuinfo")

# Settings whose change between a checkpoint and its resume can change the bits. The CPU model too:
# MKL's AUTO branch follows the instruction set, and a preempted job may come back on other nodes.
RESUME_SENSITIVE = ("cpu_threads", "mkl_cbwr", "cpu")

# mkl_cbwr.h: branch codes and the strict flag.
_MKL_CBWR_AUTO = 2
_MKL_CBWR_STRICT = 0x10000
_MKL_CBWR_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                      9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}


def prepare_environment() -> None:
    """Set `REPRODUCIBLE_ENV` where unset. Call before torch is imported (the CLI does)."""
    for name, value in REPRODUCIBLE_ENV.items():
        os.environ.setdefault(name, value)


def apply(threads: int | None = None) -> dict[str, Any]:
    """Put the reproducibility settings in force for this process; returns `settings()`."""
    import torch

    prepare_environment()
    # Set even when it is torch's own choice: a count torch never set is re-derived from MKL's
    # (mkl_get_max_threads) in every thread that first computes; a set one is the same everywhere.
    torch.set_num_threads(threads if threads is not None else torch.get_num_threads())
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every uninitialised tensor (`torch.empty`, every op's output
    # buffer) with NaN by default: a debugging aid that changes no result of a program that never
    # reads memory before writing it, and 2-3% of a quickstart step on CPU (docs/bench-overhead.md).
    # A property of the module's class (torch/utils/deterministic.py swaps it in), which the checker cannot see.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    mkl = _mkl()
    if mkl is not None:
        mkl.MKL_Set_Dynamic(0)
        mode = mkl.mkl_serv_cbwr_get(-1)
        chosen = os.environ["MKL_CBWR"]
        if _strict(mode):
            pass
        elif chosen != REPRODUCIBLE_ENV["MKL_CBWR"]:  # the user's own choice: kept, but said
            _warn_once(
                "MKL_CBWR in the environment is not strict; runs may differ in the last bits from one to the next",
                mkl_cbwr=chosen, fix="unset MKL_CBWR (the harness then uses AUTO,STRICT)")
        elif mkl.mkl_serv_cbwr_set(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT) != 0:
            _warn_once(
                "MKL computed before the harness could make it reproducible; runs may differ in the last bits",
                mkl_cbwr=_describe_cbwr(mode),
                fix="set MKL_CBWR=AUTO,STRICT in the environment, or build the trainer before other torch math")
    return settings()


def settings() -> dict[str, Any]:
    """The reproducibility settings in force (JSON-able), recorded with every run and checkpoint."""
    import torch

    mkl = _mkl()
    out: dict[str, Any] = {
        "cpu_threads": torch.get_num_threads(),
        "mkl_cbwr": _describe_cbwr(mkl.mkl_serv_cbwr_get(-1)) if mkl is not None else "no MKL",
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "env": {name: os.environ.get(name) for name in REPRODUCIBLE_ENV},
        "cpu": cpu().model,
    }
    if torch.cuda.is_available():
        sdpa = torch.backends.cuda
        out["cuda"] = {
            "matmul_allow_tf32": sdpa.matmul.allow_tf32,
            "matmul_allow_bf16_reduced_precision": sdpa.matmul.allow_bf16_reduced_precision_reduction,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "sdpa_backends": {"flash": sdpa.flash_sdp_enabled(), "mem_efficient": sdpa.mem_efficient_sdp_enabled(),
                              "cudnn": sdpa.cudnn_sdp_enabled(), "math": sdpa.math_sdp_enabled()},
            "nccl": {name: os.environ.get(name) for name in ("NCCL_ALGO", "NCCL_PROTO")},
        }
    return out


def open_residual(device_type: str) -> str | None:
    """The nondeterminism known on this platform that the settings above do not remove, or None.

    Open: on an Intel Xeon with AVX-512, default-threaded runs were seen to differ by
    one ulp from an early step on (a step 1 on another thread count gives the same bits; why a
    run would compute on another count was not found); never on one thread, nor on the AMD EPYC
    after it. Not tied to MKL: the suspect is one of torch's own reductions, so a build without
    MKL is named too. The conditions and figures: docs/verify-resume.md "Conditions of the
    guarantee"."""
    import torch

    if device_type == "cpu" and torch.get_num_threads() > 1 and residual_platform():
        return ("on Intel CPUs with AVX-512, runs on more than one CPU thread were seen to differ by one ulp "
                "from an early step on (cause not found; docs/verify-resume.md, \"Conditions of the guarantee\"); "
                "runs on one thread never were")
    return None


def residual_platform() -> bool:
    """Whether this CPU is of the kind the open residual was seen on (Intel, AVX-512)."""
    info = cpu()
    return info.vendor == "GenuineIntel" and "avx512f" in info.flags


def warn_of_open_residual(device_type: str) -> None:
    """One warning per process when `open_residual` names something for this run."""
    import torch

    residual = open_residual(device_type)
    if residual is not None:
        _warn_once(residual, cpu=cpu().model, cpu_threads=str(torch.get_num_threads()),
                   fix="set train.cpu_threads=1 where runs must be bitwise repeatable from one to the next")


@dataclass(frozen=True)
class Cpu:
    vendor: str
    model: str
    flags: frozenset[str]


@lru_cache(maxsize=1)
def cpu() -> Cpu:
    """This machine's CPU from /proc/cpuinfo (its first processor); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return Cpu(fields.get("vendor_id", ""), fields.get("model name", ""), frozenset(fields.get("flags", "").split()))


@cache
def _warn_once(message: str, **fields: str) -> None:
    """One warning per process however many trainers it builds (the test helpers build several)."""
    from harness.log import get_logger

    get_logger(__name__).warning(message, **fields)


def _strict(mode: int) -> bool:
    return bool(mode & _MKL_CBWR_STRICT) and (mode & 0xFFFF) != 1


def _describe_cbwr(mode: int) -> str:
    branch = _MKL_CBWR_BRANCHES.get(mode & 0xFFFF, str(mode & 0xFFFF))
    return f"{branch},STRICT" if mode & _MKL_CBWR_STRICT else branch


@lru_cache(maxsize=1)
def _mkl() -> ctypes.CDLL | None:
    """oneMKL's service API inside torch's CPU library (x86 builds link MKL statically and export
    it), or None where torch has no MKL (ARM, macOS builds)."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(library))
        for name in ("mkl_serv_cbwr_get", "mkl_serv_cbwr_set", "MKL_Set_Dynamic"):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib
