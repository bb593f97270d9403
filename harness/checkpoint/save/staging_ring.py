"""Bounded staging for background saves: one block of host memory through which the bytes of a
snapshot's tensor files stream from the live tensors to the writer (`StagingRing`).

At the step boundary the saver copies every tensor of the files (`feed`, on the training thread)
into the ring, in the order the writer writes them (files by name, tensors by name: format.py's
`snapshot_files`, tensorfile.py's `serialize`), while the persist (the writer thread) takes them
out (`chunks`) and writes and hashes them. A copy waits only for room: with a ring as large as
what it stages (the default, `capacity=None`: it grows to the largest snapshot, up to the host's
budget, half the memory available at its allocation shared by the node's ranks) nothing waits and
the step loop pays one memory copy, as with whole staging buffers; with a smaller ring the step
loop waits for the writer to drain the bytes beyond the ring, and the memory a save adds is the
ring, whatever the state's size.

Contract of the memory: a piece of the ring is handed to the writer as a memoryview over it, and
counts as free again only once nothing refers to it any longer: written, and hashed by the hash
thread that runs behind the writes (harness/storage/location.py, `BackgroundHash`). CPython frees
the piece's array when the last reference goes; a finalizer on it gives the room back, so no piece
is overwritten while any reader holds it. Pieces come back out of order (a write and its hash end
at different times); the free space is the prefix released in order.

One ring serves every background saver of a process (the persistent tier's and the local
tier's: async_saver.py's `Staging`), one save at a time: a save begins once the save before it,
by either saver, has released every piece (its bytes written and hashed, often well before its
commit: the fsync is still to come), or its writer stopped.

The memory is allocated once, ahead of the first save (`prepare`, in a thread of its own: the
pages are touched there, not in the step loop's first save), reused by every save, and pinned when
the state lives on a GPU: a `HostBlock` (checkpoint/host_memory.py) of exactly the ring's size,
not torch's caching host allocator (which rounds a block up to a power of two and keeps a freed
one); a ring that grows gives its old block back first. A GPU tensor's pieces are copied to the
host asynchronously on a side stream of its device, after the kernels queued before the save (so
the copy reads the state at the step boundary) and recorded each with an event the writer waits
for, asleep (host_memory's `copies_done`: a spinning wait took a core from training); `feed` then
makes the training stream wait for the copies, so the next step's in-place updates queue behind
them while the CPU goes on at once. (The next step's forward could overlap the copies, the
optimizer waiting only for the tensors it overwrites; not built: a forward may update buffers in
place too.)
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial

import psutil
import torch

from harness.checkpoint.host_memory import HostBlock, copies_done
from harness.checkpoint.later import Feed
from harness.checkpoint.tensorfile import ChunkedTensors
from harness.log import get_logger
from harness.repro.on_cores import on_cores
from harness.topology import topology_from_env
from optim.dtensor import local

log = get_logger(__name__)

PIECE_BYTES = 16 << 20  # the largest piece handed to the writer while streaming: small against any ring
MIN_CAPACITY = 4 * PIECE_BYTES  # room for the pieces the writer and its hash thread hold, and more

Entry = tuple[str, str, torch.Tensor]  # (file, tensor name, live tensor)
_Piece = tuple[str, str, int, int, int, bool, "torch.cuda.Event | None"]  # a piece fed, as the writer gets it


def default_host_budget() -> int:
    """The host memory a ring of unset capacity may take: half of what the host has available
    now, shared by the node's ranks (each stages its own state)."""
    return psutil.virtual_memory().available // 2 // max(1, topology_from_env().local_world_size)


def on_gpu(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether a tensor of `tensors` (a DTensor's: its local shard) lives on a GPU: then the ring
    is pinned and its copies asynchronous."""
    return any(local(t).is_cuda for t in tensors)


def staged_bytes(tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> int:
    """The bytes of the files `tensors` (file -> name -> tensor) that pass through the ring (a
    DTensor's: its local shard)."""
    return sum(local(t).numel() * t.element_size() for named in tensors.values() for t in named.values())


class StagingAborted(RuntimeError):
    """The writer stopped before it took every piece of the snapshot (its own failure is the
    background save's to report), or the staging side stopped before it copied all of them."""


class StagingRing:
    """FIFO staging memory of `capacity` bytes (None: as large as the largest snapshot staged).

    One save at a time: `begin(snapshot tensors, writer_alive)` gives the persist its
    `ChunkedTensors`, then `feed(entries)` copies the live tensors in on the training thread while
    the persist reads `chunks`; `feed` returns once every byte is copied (the live tensors may
    change from then on). `writer_alive()` says whether that save's writer still runs (it may
    raise the writer's failure): `feed` and the next `begin` wait for room only while it does."""

    def __init__(self, capacity: int | None = None, host_budget: Callable[[], int] | None = None) -> None:
        if capacity is not None and capacity < MIN_CAPACITY:
            raise ValueError(f"staging capacity {capacity} bytes is under the minimum {MIN_CAPACITY}")
        self.capacity = capacity
        self.host_budget = host_budget if host_budget is not None else default_host_budget
        self._block: HostBlock | None = None
        self._memory: torch.Tensor | None = None  # the block's bytes
        self._allocating: threading.Thread | None = None
        self._room = threading.Condition()
        # (file, name, generation, start, nbytes, last piece of the tensor, CUDA event or None)
        self._pieces: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
        self._generation = 0
        self._piece = PIECE_BYTES
        self._whole = False  # the save begun last fits the ring whole (`begin`)
        self._head = self._tail = 0  # bytes fed, bytes released in order (both since the save began)
        self._released: dict[int, int] = {}  # start -> end of pieces released ahead of the tail
        self._writer_alive: Callable[[], bool] = lambda: False  # the writer of the save begun last
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # the side stream of each GPU copied from

    @property
    def nbytes(self) -> int:
        """The memory the ring holds (0 before the first `prepare` or save)."""
        self._wait_allocated()
        return 0 if self._memory is None else self._memory.numel()

    @property
    def pinned(self) -> bool:
        """Whether the memory is pinned (it stages a GPU's tensors: asynchronous copies)."""
        self._wait_allocated()
        return self._block is not None and self._block.pinned

    @property
    def address(self) -> int | None:
        """Where the memory lies (None before it exists): the same across saves, as it is reused."""
        self._wait_allocated()
        return None if self._memory is None else self._memory.data_ptr()

    def holds(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> bool:
        """Whether the files `tensors` fit in the ring whole (after `begin` for them): then `feed`
        never waits for the writer."""
        return staged_bytes(tensors) <= self.nbytes

    def size_for(self, nbytes: int) -> int:
        """The ring's size for a snapshot of `nbytes`: the capacity, or without one `nbytes` up to
        the host's budget (`host_budget()`, at least `MIN_CAPACITY`)."""
        cap = self.capacity if self.capacity is not None else max(MIN_CAPACITY, self.host_budget())
        return max(1, min(cap, nbytes))

    def prepare(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Allocate (and touch) the memory for saves of the files `tensors` (file -> name -> tensor)
        in a thread of its own, so no save waits for it; a ring already large enough is kept. Pinned
        when a tensor lives on a GPU."""
        self._wait_allocated()
        nbytes = staged_bytes(tensors)
        size = self.size_for(nbytes)
        pin = on_gpu(t for named in tensors.values() for t in named.values())
        if self._memory is not None and self._memory.numel() >= size:
            return
        if self.capacity is None and size < nbytes:
            log.info("the staging ring is smaller than the state (the host's budget): a save streams, and the "
                     "step waits for the writer to drain the rest; set checkpoint.staging_mib to choose",
                     ring_mib=size >> 20, state_mib=nbytes >> 20)
        self._wait_drained()  # a save in flight still reads the memory being replaced
        self._memory = None
        if self._block is not None:
            self._block.release()  # given back now, not kept beside the larger one
            self._block = None
        self._allocating = threading.Thread(target=self._allocate, args=(size, pin), name="ckpt-staging-alloc",
                                            daemon=True)
        self._allocating.start()

    def _allocate(self, size: int, pin: bool) -> None:
        self._block = HostBlock(size, pinned=pin)  # its pages faulted in here, not during a save
        self._memory = self._block.tensor

    def _wait_allocated(self) -> None:
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None

    def _wait_drained(self) -> None:
        """Wait until the save begun last has released every piece it was fed, or its writer stopped."""
        with self._room:
            while self._tail < self._head and self._writer_alive():
                self._room.wait(0.05)

    def begin(self, tensors: Mapping[str, Mapping[str, torch.Tensor]], writer_alive: Callable[[], bool],
              feeds: Mapping[tuple[str, str], Sequence[Feed]] | None = None) -> dict[str, ChunkedTensors]:
        """Start a save of the files `tensors` (file -> name -> live tensor), before its persist
        starts, once the save before it no longer holds the ring (`_wait_drained`): the memory ready
        for them, and the files as the persist writes them (their tensors' names, dtypes and shapes
        as meta tensors, their bytes from this ring, once `feed` copies them). `writer_alive`: this
        save's writer (the class docstring). `feeds`: (file, name) -> what else reads that
        tensor's staged bytes, on the writer's thread as it takes them (checkpoint/later.py)."""
        self._wait_drained()
        self.prepare(tensors)
        self._wait_allocated()
        self._writer_alive = writer_alive
        # Streaming, the writer gets small pieces (room comes back piece by piece); a snapshot the
        # ring holds whole is copied a tensor at a time (a copy per 16 MiB is slower than one per tensor).
        self._whole = staged_bytes(tensors) <= self.nbytes
        self._piece = self.nbytes if self._whole else PIECE_BYTES
        with self._room:
            self._generation += 1
            self._head = self._tail = 0
            self._released.clear()
        while not self._pieces.empty():  # what an aborted save left (its writer is gone)
            self._pieces.get_nowait()
        readers = dict(feeds or {})
        return {file: ChunkedTensors({name: torch.empty(local(t).shape, dtype=t.dtype, device="meta")
                                      for name, t in named.items()},
                                     partial(self.chunks, file, readers))
                for file, named in tensors.items()}

    def feed(self, entries: Sequence[Entry]) -> None:
        """Copy the tensors of `entries` (those `begin` was given), in the writer's order, into the
        ring; waits for room while the writer drains it. Raises `StagingAborted` when the writer
        stopped (`writer_alive()` false) before making room. The writer is told to stop if this
        raises."""
        try:
            if self._whole and not on_gpu(t for _, _, t in entries):
                self._feed_whole(entries)
            else:
                for file, name, tensor in entries:
                    self._feed_tensor(file, name, tensor)
        except BaseException:
            self._pieces.put(None)
            raise
        finally:
            for device, side in self._streams.items():
                torch.cuda.current_stream(device).wait_stream(side)  # the next step's updates after the copies

    def _feed_whole(self, entries: Sequence[Entry]) -> None:
        """`feed` of host tensors into a ring that holds them all: a piece per tensor, placed in
        order, copied on every core (the step loop waits for this copy and nothing else runs:
        repro/on_cores.py), then handed to the writer in order."""
        assert self._memory is not None
        placed = []
        for file, name, tensor in entries:
            flat = local(tensor).detach().contiguous().reshape(-1).view(torch.uint8)
            if flat.numel():  # the file has no bytes of an empty tensor (tensorfile.py writes none)
                placed.append((file, name, flat, self._head))
                self._head += flat.numel()
        memory = self._memory
        on_cores(lambda piece: memory[piece[3]:piece[3] + piece[2].numel()].copy_(piece[2]), placed, self._head,
                 each_uses=torch.get_num_threads())
        for file, name, flat, start in placed:
            self._pieces.put((file, name, self._generation, start, flat.numel(), True, None))

    def _feed_tensor(self, file: str, name: str, tensor: torch.Tensor) -> None:
        src = local(tensor).detach()
        if not src.numel():
            return  # the file has no bytes of it (tensorfile.py writes none)
        flat = src.contiguous().reshape(-1).view(torch.uint8)
        side = self._side_stream(flat) if flat.is_cuda else None
        assert self._memory is not None
        size, total, done = self._memory.numel(), flat.numel(), 0
        while done < total:
            start = self._head
            at = start % size
            n = min(total - done, size - at, self._piece)
            self._wait_room(start + n - size)
            piece = self._memory[at:at + n]
            ready: torch.cuda.Event | None = None
            if side is not None:
                with torch.cuda.stream(side):
                    piece.copy_(flat[done:done + n], non_blocking=True)
                ready = copies_done(side)
            else:
                piece.copy_(flat[done:done + n])
            done += n
            self._head = start + n
            self._pieces.put((file, name, self._generation, start, n, done == total, ready))

    def _side_stream(self, flat: torch.Tensor) -> torch.cuda.Stream:
        """The side stream the device-to-host copies of `flat` run on, after every kernel queued so
        far on the training stream (`flat` itself may be the output of one: a contiguous copy);
        the allocator keeps `flat`'s memory until the side stream is past it."""
        side = self._streams.get(flat.device)
        if side is None:
            side = self._streams[flat.device] = torch.cuda.Stream(flat.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(flat.device))
        flat.record_stream(side)
        return side

    def _wait_room(self, tail_needed: int) -> None:
        with self._room:
            while self._tail < tail_needed:
                if not self._writer_alive():
                    raise StagingAborted("the background save stopped before it wrote the snapshot")
                self._room.wait(0.05)

    def chunks(self, file: str, feeds: Mapping[tuple[str, str], Sequence[Feed]], name: str) -> Iterator[memoryview]:
        """The bytes of tensor `name` of `file`, piece by piece, as `feed` copies them in (the
        writer's side: it must ask for the tensors in the order they are fed), each given first
        to what `feeds` lists for the tensor (`begin`)."""
        readers = feeds.get((file, name), ())
        while True:
            got = self._pieces.get()  # the memory exists once a piece does (`feed` allocated it)
            if got is None:
                raise StagingAborted("the snapshot's staging stopped before every tensor was copied")
            got_file, got_name, generation, start, n, last, ready = got
            if (got_file, got_name) != (file, name):
                raise StagingAborted(f"the writer asked for {file}/{name}, the ring holds {got_file}/{got_name}")
            if ready is not None:
                ready.synchronize()
            memory = self._memory
            assert memory is not None
            at = start % memory.numel()
            array = memory[at:at + n].numpy()
            weakref.finalize(array, self._release, generation, start, start + n)
            piece = memoryview(array)  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on Python >= 3.12
            for reader in readers:
                reader.update(piece)
                if last:
                    reader.finish()
            yield piece
            del array, piece
            if last:
                return

    def _release(self, generation: int, start: int, end: int) -> None:
        with self._room:
            if generation != self._generation:
                return  # a piece of an earlier, abandoned save
            self._released[start] = end
            while self._tail in self._released:
                self._tail = self._released.pop(self._tail)
            self._room.notify_all()
