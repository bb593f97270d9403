"""A pass over many large tensors spread over the process's cores: `on_cores`.

What it is for: the passes a save makes over the whole state at the step boundary, while the step
loop waits for them (the finite-state check, the fingerprints' state hash). The training thread
runs them alone, on one core, even where the training step itself runs on one thread; the other
cores wait with it. The work of each pass releases the GIL (torch's kernels, xxhash), so Python
threads run it in parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from harness.topology import process_cores
from optim.dtensor import local

T = TypeVar("T")
R = TypeVar("R")

# Below this, one thread: starting a pool and handing out the work costs more than it saves.
MIN_BYTES = 64 << 20


def cores() -> int:
    """The cores this process may run on."""
    return len(process_cores())


def host_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of `tensors` (a DTensor's: its local shard) when every one is in host memory, else
    0: a GPU tensor is read on the training thread's CUDA stream, which a thread of `on_cores`
    would not be on (a stream is per thread), so such a pass stays on the training thread."""
    shards = [local(t) for t in tensors]
    return 0 if any(t.device.type != "cpu" for t in shards) else sum(t.numel() * t.element_size() for t in shards)


def on_cores(fn: Callable[[T], R], items: Sequence[T], nbytes: int, each_uses: int = 1) -> list[R]:
    """`[fn(item) for item in items]`, in that order, computed on a thread per core when the items
    hold `nbytes` >= `MIN_BYTES` (below that, on this thread). `each_uses`: the threads one call
    of `fn` runs on by itself (a torch kernel: `torch.get_num_threads()`), so the cores are shared
    out, not oversubscribed: with torch's own threads on every core, the calls run one at a time
    here. `fn` must release the GIL for its work, and be safe to run on several items at once. An
    exception of `fn` is raised here."""
    threads = min(cores() // max(1, each_uses), len(items))
    if threads < 2 or nbytes < MIN_BYTES:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="state-pass") as pool:
        return list(pool.map(fn, items))
