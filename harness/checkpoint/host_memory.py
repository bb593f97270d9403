"""Host memory that tensors pass through between a GPU and files: blocks of an exact size, pinned
by registration and given back when released (`HostBlock`), the events a host thread waits on
without spinning (`copies_done`), and pieces of such memory lent out until nothing reads them
(`LentPieces`).

Why not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds every block up
to a power of two (a 20 GiB staging ring took 32 GiB of page-locked memory) and keeps a freed
block for the next pinned allocation, never giving it back: a ring that grew held both blocks for
the rest of the run, and a block of a new size was a cudaHostAlloc at a save. A `HostBlock` is an
anonymous mapping of the size asked (rounded up to a page) that CUDA registers (cudaHostRegister)
in pieces of `REGISTER_BYTES`, so no single call holds the driver long; `release()` unregisters
and unmaps it. Where registration fails the block stays pageable (a warning says so): copies into
it are then synchronous, still correct.

Why blocking events: a host thread waiting on an event made by `torch.cuda.Event()` spins
(cudaEventSynchronize polls unless the event has cudaEventBlockingSync), a core taken from the
training processes for as long as a background writer waits for its copies. `copies_done(stream)`
records an event whose `synchronize()` sleeps.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable

import torch

from harness.log import get_logger

log = get_logger(__name__)

REGISTER_BYTES = 1 << 30  # one cudaHostRegister call at most: the driver's lock is held per call


def _register(address: int, nbytes: int) -> bool:
    """Page-lock `nbytes` at `address` for CUDA; False where the driver refuses."""
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)) == 0  # type: ignore[no-untyped-call]


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


class HostBlock:
    """`nbytes` of host memory as a flat uint8 `tensor`, exactly that size (rounded up to a page),
    pinned for a GPU's asynchronous copies when `pinned` (and the driver agrees: `self.pinned`).
    `release()` gives it back to the system; a dropped block is released by its finalizer. The
    owner releases it only once no copy into or out of it is pending and nothing reads it."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = max(1, nbytes)
        self._mapping = mmap.mmap(-1, self.nbytes)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.registered: list[int] = []
        self.pinned = pinned and self._pin()
        if not self.pinned:
            self.tensor.zero_()  # fault the pages in now, not during a save (registering does it for pinned ones)
        self._finalizer = weakref.finalize(self, _give_back, self.registered, self._mapping, _unregister)

    def _pin(self) -> bool:
        assert self.tensor is not None
        base = self.tensor.data_ptr()
        for at in range(0, self.nbytes, REGISTER_BYTES):
            if not _register(base + at, min(REGISTER_BYTES, self.nbytes - at)):
                log.warning("CUDA could not pin host memory a checkpoint passes through; copies through it are "
                            "synchronous (the step waits for them)", bytes=self.nbytes)
                for address in self.registered:
                    _unregister(address)
                self.registered.clear()
                return False
            self.registered.append(base + at)
        return True

    def release(self) -> None:
        """Unpin and unmap the memory now; the block must not be used after."""
        self.tensor = None
        self._finalizer()


def _give_back(registered: list[int], mapping: mmap.mmap, unregister: Callable[[int], None]) -> None:
    for address in registered:
        unregister(address)
    registered.clear()
    try:
        mapping.close()
    except BufferError:  # a view of it is still alive somewhere: it is unmapped when that goes
        pass


def copies_done(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on `stream` after the copies queued there so far, whose `synchronize()`
    puts the waiting host thread to sleep instead of spinning (module docstring)."""
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # torch: unannotated
    event.record(stream)
    return event


class LentPieces:
    """`count` pieces of `piece_bytes` of one `HostBlock`, lent one at a time (`borrow`): a piece is
    free again once nothing refers to the memoryview it was lent as (a reader that hashes behind
    the reads keeps one until it has hashed it: storage/location.py, `HashingReader`) and the
    copy recorded on it (`copied`) is done. Thread-safe."""

    def __init__(self, count: int, piece_bytes: int, pinned: bool) -> None:
        self.piece_bytes = piece_bytes
        self.block = HostBlock(count * piece_bytes, pinned)
        self._free = list(range(count))
        self._events: dict[int, torch.cuda.Event | None] = {}
        self._room = threading.Condition()

    def borrow(self, nbytes: int) -> tuple[memoryview, torch.Tensor, Callable[[torch.cuda.Event | None], None]]:
        """A free piece's first `nbytes` as (a memoryview to fill, the same bytes as a tensor, and
        `copied(event)` to call once a copy out of it is queued: the piece is not lent again before
        the event). Waits for a piece to come back."""
        with self._room:
            while not self._free:
                self._room.wait()
            index = self._free.pop()
        pending = self._events.pop(index, None)
        if pending is not None:
            pending.synchronize()
        assert self.block.tensor is not None
        piece = self.block.tensor[index * self.piece_bytes:index * self.piece_bytes + nbytes]
        array = piece.numpy()
        weakref.finalize(array, self._give_back, index)
        return memoryview(array), piece, lambda event: self._events.__setitem__(index, event)  # type: ignore[arg-type]

    def _give_back(self, index: int) -> None:
        with self._room:
            self._free.append(index)
            self._room.notify()
