"""Asynchronous checkpointing: snapshot at the step boundary, persist in the background.

    saver = AsyncSaver(Committer(store), when_busy="wait")
    ...after step N:
    saver.save(N, trainer.state.parts(), meta=meta)   # blocks only for the copy
    ...each later step:
    saver.poll()                                         # raises a background failure
    ...at the end or on preemption:
    saver.finish()                                       # waits until the commit is done

A `Saver` (saver.py) whose commit runs in the background. What the step loop pays is the
*snapshot*: `capture(parts)` (references, no copies), then a copy of every tensor into CPU
staging memory: the tensor files' bytes into the staging ring (staging_ring.py: of
`staging_bytes` at most, streamed to the writer while they are copied, so with a ring smaller
than the state the step loop waits for the writer to drain the rest), the sharded parts'
tensors (FSDP, written through DCP) into whole staging buffers. The *persist* (the committer:
serialize, hash, write, fsync, atomic rename, retention through `store.committing`) runs in a
`BackgroundJob` (background.py) over that memory while training continues. The files are
byte-identical to a synchronous `store.save` of the same state: the same `commit` writes them,
the same bytes in the same order.

Trade-offs, stated before the code:
* A thread, not a process: the persist is file I/O and hashing, both of which release the GIL, and
  a thread shares the staging buffers without a second copy or any pickling. The cost is that
  the persist competes with the training step for CPU cores (measured in docs/bench-async.md).
* One save in flight, and one ring and one set of staging buffers, reused by every save: memory
  does not grow with the number of saves. The ring is allocated (its pages touched) in a thread
  of its own by `prepare`, which the step loop calls after the first step, so no save waits for
  it; the sharded parts' buffers are allocated at the first save (reallocated only for a tensor
  whose shape or dtype changed). The buffers are owned by the in-flight persist until it ends, so a new
  snapshot first waits for it (`when_busy="wait"`) or is not taken at all (`"skip"`); this is
  what makes reusing them safe.
* GPU state is copied into pinned buffers on a side stream; the training stream then waits on an
  event recorded after the copies, so the next step's in-place optimizer update cannot overwrite
  a tensor before its copy is done, while the CPU returns to the step loop at once. The persist
  thread waits for the same event before it reads the buffers.
* The JSON half of a snapshot is plain data built fresh by `capture` (new dicts and lists, immutable
  scalars), so it is already detached from the live objects and needs no copy.
* A failure in the background is kept and raised by the next `poll`/`save`/`finish` the step
  loop makes, wrapped in an error that names the step; it never passes silently. A storage
  outage stays an outage (`Unavailable`: the retryable exit 69), never a user error.
* A persist that is slow is reported while it runs: `poll` and every wait log a warning (and
  call `on_slow`) once it has run `slow_after_s` (the larger of 30 s and twice the previous
  persist), and again each such interval. Nothing waits for it past `save_deadline_s` from its
  start: then `SaveStalled` (an `Unavailable`) names the step, and the step loop exits with the
  retryable code instead of waiting on a storage that does not answer. A kill during
  the persist leaves at worst an uncommitted temporary folder (the commit is atomic), so the
  previous checkpoint stays the newest good one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import torch

from harness.checkpoint.errors import CheckpointError, failed_save, still_committed
from harness.checkpoint.format import Snapshot, capture, tensor_view
from harness.checkpoint.host_memory import HostBlock, copies_done
from harness.checkpoint.later import Feed, deferring, later_values
from harness.checkpoint.save.background import BackgroundJob
from harness.checkpoint.save.commit import Committed, Committer
from harness.checkpoint.save.saver import Saver, Submitted
from harness.checkpoint.save.staging_ring import Entry, StagingRing
from harness.checkpoint.shard_files import SHARDED
from harness.errors import Unavailable, UserError
from harness.log import get_logger
from optim.dtensor import local

log = get_logger(__name__)


class BackgroundSaveError(RuntimeError):
    """A background persist failed with an unexpected error (a bug or an infrastructure fault);
    the original exception is its `__cause__`."""


class SaveStalled(Unavailable):
    """A background persist did not commit within the save deadline (storage not answering)."""


# A persist is "slow" after this long at least (and after twice the previous one's time).
SLOW_FLOOR_S = 30.0


class StagingBuffers:
    """CPU copies of a snapshot's tensors, kept across saves and keyed by (file, tensor name).

    `stage(tensors)` (file -> name -> tensor) copies every tensor into its buffer and returns the
    buffers in the same layout plus the CUDA events the copies finish at (empty for CPU state). The
    buffers are views of one `HostBlock` (checkpoint/host_memory.py) of exactly their total size,
    pinned when a source lives on a GPU (so the device-to-host copies run asynchronously); it is
    made anew, the old one given back, only when the tensors' names, shapes or dtypes changed.
    Torch's pinned allocator would have rounded each buffer up to a power of two and kept every
    block it ever made, each new one a cudaHostAlloc at a save.
    """

    ALIGN = 64  # each buffer's first byte: aligned for any dtype's view

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._layout: tuple[object, ...] | None = None
        self._block: HostBlock | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, file: str, name: str) -> torch.Tensor:
        return self._buffers[(file, name)]

    def stage(self, tensors: Mapping[str, Mapping[str, torch.Tensor]]
              ) -> tuple[dict[str, dict[str, torch.Tensor]], list[torch.cuda.Event]]:
        sources = {(file, name): local(whole) for file, named in tensors.items() for name, whole in named.items()}
        self._fit(sources)
        staged: dict[str, dict[str, torch.Tensor]] = {}
        on_gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for file, named in tensors.items():
            out = staged.setdefault(file, {})
            for name, whole in named.items():
                src = sources[(file, name)]  # a DTensor's own shard: each rank stages only what it holds
                buf = self._buffers[(file, name)]
                # A DTensor's buffer keeps its spec (mesh, placements, global shape), on the CPU:
                # `DTensor.from_local` would move it back to the mesh's device (as DCP's own
                # staging does, the local tensor is swapped, never moved). `type(whole)` is DTensor,
                # named without importing it (optim/dtensor.py): untyped here, as torch's stubs know
                # neither its constructor nor `_spec` on a Tensor.
                dtensor: Any = whole
                out[name] = buf if src is whole else type(dtensor)(buf, dtensor._spec, requires_grad=False)
                if src.is_cuda:
                    on_gpu.setdefault(src.device, []).append((buf, src))
                else:
                    buf.copy_(src.detach())
        events = [self._copy_from_gpu(device, pairs) for device, pairs in on_gpu.items()]
        return staged, events

    def _fit(self, sources: Mapping[tuple[str, str], torch.Tensor]) -> None:
        """Buffers for `sources`: the current ones when names, shapes and dtypes are the same, else
        views of a new block (the persist that read the old one has ended: `Staging.take_buffers`)."""
        pinned = any(src.is_cuda for src in sources.values())
        layout = (pinned, *((key, tuple(src.shape), src.dtype) for key, src in sources.items()))
        if layout == self._layout:
            return
        starts, total = {}, 0
        for key, src in sources.items():
            starts[key] = total
            total += -(-src.numel() * src.element_size() // self.ALIGN) * self.ALIGN
        if self._block is not None:
            self._block.release()
        self._block = HostBlock(total, pinned=pinned)
        memory = self._block.tensor
        assert memory is not None
        self._buffers = {key: memory[starts[key]:starts[key] + src.numel() * src.element_size()]
                         .view(src.dtype).view(src.shape) for key, src in sources.items()}
        self._layout = layout

    def _copy_from_gpu(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: unannotated
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)  # the copies see every kernel queued up to the step boundary
        with torch.cuda.stream(side):
            for buf, src in pairs:
                buf.copy_(src.detach(), non_blocking=True)
                src.record_stream(side)  # the allocator must not reuse src's memory before the copy ran
        done = copies_done(side)  # the persist waits on it asleep
        main.wait_event(done)  # the next step's in-place updates run after the copies
        return done


class Staging:
    """The host memory a process's background saves copy their snapshots into: the staging ring
    (the tensor files, staging_ring.py) and the sharded parts' buffers (`StagingBuffers`). The
    persistent tier's saver makes one; the local tier's saver shares it (local_tier.py), so a rank
    holds one staging memory for both tiers, used by one save at a time: the ring is free again
    once the save before, by either saver, has released every piece (often before its commit), the
    buffers once the persist that read them (`buffers_reader`) has ended."""

    def __init__(self, capacity: int | None = None) -> None:
        self.ring = StagingRing(capacity)
        self.buffers = StagingBuffers()
        self.buffers_reader: BackgroundJob | None = None

    def take_buffers(self, job: BackgroundJob) -> StagingBuffers:
        """The buffers for a save that `job` will persist, once another saver's persist that reads
        them has ended (waited for within its own deadline; its failure is left to its owner)."""
        reader = self.buffers_reader
        if reader is not None and reader is not job:
            reader.wait_bounded()
        self.buffers_reader = job
        return self.buffers


def ring_order(tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> list[Entry]:
    """The tensors of the files `tensors` in the order the writer asks for them: files by name,
    tensors by name within a file (format.py's `snapshot_files`, tensorfile.py's `serialize`)."""
    return [(file, name, tensors[file][name]) for file in sorted(tensors) for name in sorted(tensors[file])]


def ring_feeds(snapshot: Snapshot, streamed: Mapping[str, Mapping[str, torch.Tensor]]
               ) -> dict[tuple[str, str], list[Feed]]:
    """Bind every `Later` value of `snapshot` (checkpoint/later.py): a tensor it reads that the
    ring stages (`streamed`, file -> name -> tensor) is fed to it from the ring by the writer
    (the result: (file, name) -> its readers); any other it reads now."""
    where = {tensor_view(t): (file, name) for file, named in streamed.items() for name, t in named.items()}
    feeds: dict[tuple[str, str], list[Feed]] = {}

    def stage(t: torch.Tensor, feed: Feed) -> bool:
        at = where.get(tensor_view(t)) if t.numel() else None  # an empty tensor has no piece to feed
        if at is not None:
            feeds.setdefault(at, []).append(feed)
        return at is not None

    for later in later_values(snapshot.parts):
        later.bind(stage)
    return feeds


class AsyncSaver(Saver):
    """Snapshot-then-persist through the committer `commit`, at most one persist in flight.

    `when_busy`: what `save` does while the previous persist still runs: "wait" for it, or
    "skip" this save (logged; `save` returns None). `must=True` always waits (final and
    preemption saves). `on_commit(Committed)` runs in the background thread after each commit.
    `persist_delay_s` sleeps before each persist: a test hook that widens the window in which a
    save is in flight (config `debug.persist_delay_s`). `save_deadline_s` bounds every wait for a
    persist (counted from its start; None = unbounded) and `on_slow(step, seconds)` is told about
    a slow one (see the module docstring); `slow_floor_s` is the least time that counts as slow.
    `rank`, `per_rank`: the snapshot's (saver.py); each rank stages `commit.mine(snapshot)`.
    `agree(busy) -> bool` makes the ranks of a group decide alike whether a persist is still in
    flight (any rank's: `distributed.all_reduce_flag`), so every rank skips a save or every rank
    takes it and their commits stay paired; every rank must then call `save` at the same steps.
    `staging_bytes`: the staging ring's size (None: as large as the tensor files of a snapshot);
    `staging`: the staging memory of another saver to share instead (`Staging`: the local tier's).
    """

    background = True

    def __init__(self, commit: Committer, *, when_busy: Literal["wait", "skip"] = "wait",
                 on_commit: Callable[[Committed], None] | None = None, persist_delay_s: float = 0.0,
                 save_deadline_s: float | None = None, on_slow: Callable[[int, float], None] | None = None,
                 slow_floor_s: float = SLOW_FLOOR_S, rank: int = 0, per_rank: Collection[str] = (),
                 sharded: Collection[str] = (),
                 agree: Callable[[bool], bool] = bool, last_committed: int | None = None,
                 staging_bytes: int | None = None, staging: Staging | None = None) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        super().__init__(commit, rank=rank, per_rank=per_rank, sharded=sharded, on_commit=on_commit,
                         last_committed=last_committed)
        self.when_busy, self.agree, self.persist_delay_s = when_busy, agree, persist_delay_s
        self.save_deadline_s, self.on_slow, self.slow_floor_s = save_deadline_s, on_slow, slow_floor_s
        self.staging = staging if staging is not None else Staging(staging_bytes)
        self.ring = self.staging.ring
        self.job = BackgroundJob("ckpt-persist", "the background save", failed=self._failed, watch=self._watch)
        self._last_persist_s = 0.0
        self._next_warning = 0.0

    @property
    def busy(self) -> bool:
        """Whether a persist is in flight (the staging buffers belong to it)."""
        return self.job.busy

    def save(self, step: int, parts: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None,
               must: bool = False) -> Submitted | None:
        """Snapshot `parts` as `step` and start persisting it; returns once the snapshot is taken.

        Raises the failure of an earlier persist (see `poll`) before taking a new snapshot.
        Returns None when the save was skipped (`when_busy="skip"`, a persist in flight, not `must`).
        """
        self.poll()
        waited = 0.0
        if self.agree(self.busy):
            if self.when_busy == "skip" and not must:
                log.warning("checkpoint skipped: the previous save is still being persisted",
                            step=step, persisting_step=self.job.step)
                return None
            t0 = time.perf_counter()
            self.job.wait_bounded()
            waited = time.perf_counter() - t0
            log.info("waited for the previous save before snapshotting", step=step,
                     persisting_step=self.job.step, waited_s=round(waited, 3))
            self.poll()
        t0 = time.perf_counter()
        with deferring():
            mine = self._mine(parts)
        streamed = {file: named for file, named in mine.tensors.items() if file != SHARDED}
        staged: dict[str, dict[str, torch.Tensor]] = {}
        copied: list[torch.cuda.Event] = []
        if SHARDED in mine.tensors:
            staged, copied = self.staging.take_buffers(self.job).stage({SHARDED: mine.tensors[SHARDED]})
        feeds = ring_feeds(mine, streamed)
        snapshot = mine.with_tensors({**staged, **self.ring.begin(streamed, self._writer_alive, feeds)})
        self._next_warning = time.monotonic() + max(self.slow_floor_s, 2 * self._last_persist_s)
        # A ring that holds the whole snapshot is filled before the writer starts: the copy then has
        # the cores and the memory bandwidth to itself. A smaller one streams: the writer drains it
        # while the rest is copied in.
        streams = not self.ring.holds(streamed)
        if streams:
            self.job.start(step, self._persist, step, snapshot, dict(meta or {}), copied)
        self.ring.feed(ring_order(streamed))
        if not streams:
            self.job.start(step, self._persist, step, snapshot, dict(meta or {}), copied)
        return Submitted(step, waited + time.perf_counter() - t0, waited, snapshot.nbytes)

    def _writer_alive(self) -> bool:
        """Whether the persist still runs, while the staging waits for room: raises its failure
        once it failed, and `SaveStalled` past the save deadline, as the step loop's `poll` does."""
        self.job.poll()
        return self.job.busy

    def prepare(self, parts: Mapping[str, Any]) -> None:
        """Allocate the staging ring for snapshots of `parts` now, in a thread of its own (the step
        loop calls it once the first step made the optimizer's state), so the first save does not
        wait for the memory."""
        self.ring.prepare({file: named for file, named in self._mine(parts).tensors.items() if file != SHARDED})

    def _mine(self, parts: Mapping[str, Any]) -> Snapshot:
        return self.commit.mine(capture(parts, rank=self.rank, per_rank=self.per_rank, sharded=self.sharded))

    def _persist(self, step: int, snapshot: Snapshot, meta: dict[str, Any], copied: list[torch.cuda.Event]) -> None:
        t0 = time.perf_counter()
        for event in copied:
            event.synchronize()
        if self.persist_delay_s:
            time.sleep(self.persist_delay_s)
        ref = self.commit(step, snapshot, meta=meta)
        self._last_persist_s = time.perf_counter() - t0
        self.last_committed = step
        if self.on_commit is not None:
            self.on_commit(Committed(ref, self._last_persist_s, snapshot.nbytes))

    def _failed(self, step: int, e: BaseException) -> Exception:
        """A failed persist as the step loop raises it: `CheckpointError` (a `UserError`) when the
        store raised one or a person must fix the storage, the same `Unavailable` kind for a
        storage outage, else `BackgroundSaveError`; each names the step."""
        fixable = failed_save(step, e, self.last_committed, self.commit.url)
        if fixable is not None:
            return fixable
        still = still_committed(self.last_committed)
        message = f"the background save of the checkpoint at step {step} failed: {e}"
        if isinstance(e, Unavailable):
            return type(e)(f"{message}; {still}")
        if isinstance(e, UserError):
            return CheckpointError(f"{message}; {still}")
        return BackgroundSaveError(f"{message} ({type(e).__name__}); {still}")

    def _watch(self, step: int, elapsed: float) -> float:
        """A running persist: warn each slow interval, `SaveStalled` past the save deadline;
        returns the seconds until the next check."""
        if self.save_deadline_s is not None and elapsed >= self.save_deadline_s:
            raise SaveStalled(
                f"the background save of the checkpoint at step {step} has not committed after "
                f"{elapsed:.0f}s (checkpoint.save_deadline_s = {self.save_deadline_s:g}): the storage at "
                f"{self.commit.url} is not answering; {still_committed(self.last_committed)}")
        now = time.monotonic()
        if now >= self._next_warning:
            log.warning("the background save is slow: still persisting", step=step,
                        seconds=round(elapsed, 1), url=self.commit.url)
            if self.on_slow is not None:
                self.on_slow(step, elapsed)
            self._next_warning = now + max(self.slow_floor_s, 2 * self._last_persist_s)
        until = self._next_warning - now
        if self.save_deadline_s is not None:
            until = min(until, self.save_deadline_s - elapsed)
        return until

    def poll(self) -> None:
        """Raise the failure of a finished persist, once (see `_failed`), then one of work the
        committer left running (an upload). While a persist runs: warn if it is slow, raise
        `SaveStalled` once it has run past the save deadline."""
        self.job.poll()
        self.commit.poll()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight persist, at most `timeout` seconds; True when none is left."""
        return self.job.wait(timeout)

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the in-flight persist is committed, then raise its failure if it failed;
        then the same for the committer's work (a local-first upload). Raises `TimeoutError` if
        the persist is still running after `timeout` seconds, `SaveStalled` at the save deadline."""
        self.job.finish(timeout)
        self.commit.finish(timeout)

    def close(self) -> None:
        """On an error exit: let a good in-flight save commit (within the save deadline), and
        log (not raise) its failure, so the error already propagating stays the one reported;
        then the committer's work."""
        self.job.close()
        self.commit.close()
