"""Whether the host memory a training process frees goes back to the kernel (`train.host_heap`).

Why: glibc's malloc hands a large freed block back to the kernel: a block over its mmap threshold
(128 KiB, rising with what is freed to at most 32 MiB) is unmapped, and a heap whose free top
passes the trim threshold is cut back. A training step frees and allocates the same large blocks
every step (the gradients, which `zero_grad(set_to_none=True)` frees, and the optimizer's
temporaries), so each step faulted them in again, pages the kernel zeroes and, on a VM that
reports its free pages to the host, pages the host must back again. On this project's 2-core VM,
a 302M-parameter GPT with AdamW on one thread took 487,000-498,000 minor faults and 2.81 s a step;
with the memory kept, 0 faults and 2.20 s, and a step beside a background save went from 1.09x
a step without one to 1.02x (docs/bench-scale.md, sixth pass).

Contract:
- `apply(setting)` runs once per training process, before the trainer is built, and returns what
  holds: `"keep"` or `"system"`.
- `"keep"`: glibc's `mallopt(M_MMAP_MAX, 0)`, so every block comes from the heap, and
  `mallopt(M_TRIM_THRESHOLD, -1)`, so the heap is never cut back. Memory the process frees stays
  in it for its next allocations; its RSS stays at its peak (the same 302M run: a peak RSS of
  8.66 GiB against 8.33 GiB). A C library without glibc's `mallopt`: one info line, and `"system"`.
- `"system"`: the C library's defaults, untouched.
- Nothing here changes a result: every torch tensor is 64-byte aligned either way, and the setting
  is not part of a run's math.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from typing import Literal

from harness.log import get_logger

log = get_logger(__name__)

HostHeap = Literal["keep", "system"]

# glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def apply(setting: HostHeap) -> HostHeap:
    """Set this process's heap to `setting` (see the module's contract); what holds."""
    if setting == "system":
        return "system"
    mallopt = _glibc_mallopt()
    # -1 as the trim threshold is "never" (mallopt(3)); 0 as the mmap count is "never mmap a block".
    if mallopt is None or not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1)):
        log.info("train.host_heap = 'keep' needs glibc's mallopt; this process's allocator is left as it is",
                 libc=" ".join(platform.libc_ver()) or "unknown")
        return "system"
    return "keep"


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt`, or None under another C library (musl's is a stub; macOS has none)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
