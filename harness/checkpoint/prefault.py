"""The new tensors a load reads into, their memory faulted in by a second thread meanwhile.

A resumed process has no optimizer state yet, so a load reads the optimizer's tensors (two thirds
of an AdamW checkpoint) into new memory, and every 4 KiB page of it faults the first time the
read writes it. Those faults are most of such a read: 2.63 GiB read from the page cache took
1.7 s into new tensors and 0.7 s into tensors faulted in by another thread meanwhile (docs/bench-scale.md,
"Fourth pass"); in a virtual machine whose host has to back the pages anew, faults cost up to
4x more. The faults of different pages run in parallel on different cores, so `Prefault`
allocates the new tensors up front and a thread writes one byte of each of their pages, from the
last tensor backwards, while the load reads from the first tensor forwards.

Each tensor is either faulted in whole by the thread before the load reads into it, or taken by
the load first and then never touched by the thread: the two never write the same tensor at
once, so the thread's zeros cannot land on bytes already read. Tensors under `MIN_BYTES` are
left to the load (a handoff costs more than their faults).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

PAGE_BYTES = 4096  # the smallest page size of the hosts this runs on: one write faults each page in
MIN_BYTES = 1 << 20

_FREE, _FAULTING, _FAULTED, _TAKEN = range(4)


class Prefault:
    """The new, empty tensors `tensors` (in the order the load reads them), faulted in from the
    last backwards by a daemon thread from construction until `close` (a context manager), but for
    those the load has taken. `take(i)` hands tensor i to the load. `faulted`: the
    bytes the thread faulted in (for tests and logs)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._state = [_FREE if t.nbytes >= MIN_BYTES else _TAKEN for t in self._tensors]
        self._cond = threading.Condition()
        self._stop = False
        self.faulted = 0
        self._thread = None
        if _FREE in self._state:
            self._thread = threading.Thread(target=self._run, name="ckpt-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for i in reversed(range(len(self._tensors))):
            with self._cond:
                if self._stop:
                    return
                if self._state[i] != _FREE:
                    continue
                self._state[i] = _FAULTING
            _fault_in(self._tensors[i])
            with self._cond:
                self._state[i] = _FAULTED
                self.faulted += self._tensors[i].nbytes
                self._cond.notify_all()

    def take(self, i: int) -> torch.Tensor:
        """Tensor i, for the load to write: once the thread has faulted it in when it has started
        to, else at once (the thread then leaves it alone)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state[i] != _FAULTING)
            self._state[i] = _TAKEN
        return self._tensors[i]

    def close(self) -> None:
        """Stop the thread and wait for it (at most one tensor's faults)."""
        with self._cond:
            self._stop = True
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Prefault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fault_in(t: torch.Tensor) -> None:
    """Write a zero into every page of `t`'s memory (a dense CPU tensor whose values do not matter
    yet). The op releases the GIL."""
    flat = t.reshape(-1).view(torch.uint8)
    with torch.no_grad():
        flat[::PAGE_BYTES].zero_()
        flat[-1:].zero_()
