"""Peer copies of the local tier: each rank's local checkpoints also kept by a rank on another node.

A node that is gone with its disk (or a RAM tier after a reboot) takes its ranks' local
checkpoints with it. With several ranks, after each local save rank r sends the files of its
new local checkpoint to rank (r + jump) mod world (`peer_jump`; by default LOCAL_WORLD_SIZE, the
same local rank on the next node) and receives those of rank (r - jump) mod world, which it
commits in its own local folder at `DIR/<run id>/peer-of-rank-NNNNN/` (NNNNN: the owner's rank)
as an ordinary `CheckpointStore` commit: the same files, the same atomic commit, a BLAKE3
manifest of its own whose records must equal the sender's (a copy damaged on the way is never
committed). Retention keeps the newest `keep`, as in the owner's folder.

Wire (`transfer`): over a gloo group of its own (`peer_group`, host memory whatever the training
backend), point to point: the manifest's length, the manifest, then the files in manifest order,
each cut into messages of `CHUNK_BYTES` (the last one of a file shorter; both ends know every
file's size from the manifest). A received message is written (and hashed) into the peer folder
as it arrives, so the memory an exchange holds is a message each way plus what the hash thread
has not hashed yet (`location.BackgroundHash`, bounded; in practice a message or two, as hashing
is faster than the wire), never a whole file. Sending and receiving run at once (`isend`/`irecv`,
the k-th message each way together), so a ring of ranks that each send and receive cannot
deadlock.

In the background (`PeerCopies`): the exchange of a local save runs in a `BackgroundJob`
(background.py) while training goes on. Every rank makes its local saves at the same steps, so
the exchange threads of all ranks run the same sequence of exchanges and partners meet. One
exchange in flight at most: the local tier waits for it (`wait`) before its next local save, a
`drop_after` (a rollback or a resume), and at the end of the run (local_tier.py), so retention
never deletes a checkpoint while it is being sent, memory stays a message each way, and the last
peer copy exists when a run finishes. The exchange uses only the peer group, which is separate
from the training group and from the persistent saver's side group, so its thread and the
training collectives never interleave on one group; the group is made in the main thread, by
every rank at the same point (`PeerCopies()`). Recovery from peer copies is
checkpoint/save/local_recovery.py: it sees committed copies only.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.manifest import MAX_MANIFEST_BYTES, FileRecord, parse_manifest
from harness.checkpoint.save.background import BackgroundJob
from harness.checkpoint.save.node_folders import peer_store
from harness.checkpoint.store import CheckpointStore
from harness.config import LocalTierSection
from harness.log import get_logger
from harness.parallel import distributed
from harness.storage.location import open_read
from harness.topology import topology_from_env

log = get_logger(__name__)

# A peer that dies mid-copy must not hold its partner for gloo's default 30 minutes; the hang
# watchdog around the save usually ends the process sooner.
PEER_TIMEOUT_S = 300.0
# On an error exit a partner may be held in a training collective by this very rank and never
# take its side of the exchange in flight: the exit waits this long for it, not PEER_TIMEOUT_S.
CLOSE_WAIT_S = 10.0
# The size of a message on the wire: the memory an exchange holds each way, whatever a file's size.
CHUNK_BYTES = 16 << 20


def peer_jump(section: LocalTierSection, world: int) -> int:
    """How many ranks away each rank's peer copies go (0: none): `section.peer_jump`, else
    LOCAL_WORLD_SIZE; none at world size 1 or when the jump comes round to the rank itself."""
    jump = topology_from_env().local_world_size if section.peer_jump is None else section.peer_jump
    return jump % world if world > 1 else 0


@functools.cache
def peer_group() -> Any:
    """The gloo group peer copies travel on, made once per process. Collective: every rank calls
    it first at the same point (a recovery that moves copies, else the local tier's start)."""
    return distributed.new_side_group(PEER_TIMEOUT_S)


@dataclass(frozen=True)
class Outgoing:
    """The committed checkpoint `ref` of `store`, to be sent to rank `to`."""

    to: int
    store: CheckpointStore
    ref: CheckpointRef


@dataclass(frozen=True)
class Incoming:
    """A checkpoint to be received from rank `sender` and committed in `store`."""

    sender: int
    store: CheckpointStore


def transfer(outgoing: Outgoing | None, incoming: Incoming | None) -> CheckpointRef | None:
    """Send `outgoing` and receive `incoming` at once (module docstring); the two partners of each
    direction call it with matching sides. Returns the checkpoint committed from what arrived
    (None without `incoming`), at the step its manifest names. `CheckpointCorrupt` when the bytes
    that arrived do not match the sender's manifest (nothing is committed then); every message is
    sent and received first either way, so no partner is left waiting."""
    group = peer_group()
    to = outgoing.to if outgoing else None
    sender = incoming.sender if incoming else None
    mine = outgoing.store.manifest(outgoing.ref) if outgoing else None
    header = mine.to_bytes() if mine else b""
    length = _swap(group, to, torch.tensor([len(header)]), sender, torch.zeros(1, dtype=torch.int64))
    if sender is not None and not 0 < int(length) <= MAX_MANIFEST_BYTES:
        raise CheckpointCorrupt(f"a peer copy from rank {sender}: a manifest of {int(length)} bytes")
    theirs = _swap(group, to, _tensor(header), sender,
                   None if sender is None else torch.empty(int(length), dtype=torch.uint8))
    wire = _Wire(group, outgoing, mine.files if mine else ())
    try:
        if incoming is None:
            wire.send_rest()
            return None
        assert theirs is not None  # received into: incoming, so a sender
        received = parse_manifest(theirs.numpy().tobytes(), f"the peer copy from rank {sender}")
        store = incoming.store

        with store.committing(received.step, peer_of=sender) as commit:
            for record in received.files:
                commit.records.append(store.write_file(commit.work, commit.ref, record.name,
                                                       wire.receive(incoming.sender, record.size)))
            wire.send_rest()
            expected = {r.name: r for r in received.files}
            differ = [r.name for r in commit.records if expected[r.name] != r]
            if differ:
                raise CheckpointCorrupt(f"{commit.ref.url}: the copy from rank {sender} does not match its "
                                        f"manifest ({', '.join(differ)})")
        return commit.ref
    finally:
        wire.close()  # an exchange cut short leaves the outbox's file open


def messages(size: int) -> list[int]:
    """The message sizes a file of `size` bytes travels as: `CHUNK_BYTES` each, the last shorter."""
    return [min(CHUNK_BYTES, size - at) for at in range(0, size, CHUNK_BYTES)]


class _Wire:
    """One exchange's messages, the k-th sent with the k-th received (`_swap`): the files of
    `outgoing` listed in `sending`, read a message at a time into one reused buffer (`_outbox`),
    go out as the received files are asked for (`receive`), the rest by `send_rest`."""

    def __init__(self, group: Any, outgoing: Outgoing | None, sending: tuple[FileRecord, ...]) -> None:
        self.group, self.outgoing = group, outgoing
        self._out = self._outbox(sending if outgoing is not None else ())
        self._buffer = torch.empty(min(CHUNK_BYTES, max((r.size for r in sending), default=0)), dtype=torch.uint8)

    def _outbox(self, sending: tuple[FileRecord, ...]) -> Generator[torch.Tensor, None, None]:
        """Each outgoing message in turn, in the reused buffer: framed by the size the manifest
        records, so a file damaged on this disk to another length still travels as that many bytes
        (cut, or padded with zeros), and its digest tells the receiver."""
        for record in sending:
            assert self.outgoing is not None  # files to send only with an outgoing side (`__init__`)
            with open_read(self.outgoing.store.loc, f"{self.outgoing.ref.path}/{record.name}") as f:
                for n in messages(record.size):
                    out = self._buffer[:n]
                    view, got = memoryview(out.numpy()), 0  # type: ignore[arg-type]  # numpy's stubs, as tensorfile's
                    while got < n and (read := f.readinto(view[got:])):
                        got += read
                    out[got:].zero_()
                    yield out

    def close(self) -> None:
        """Close the file the outbox is reading, if the exchange stopped part-way through it."""
        self._out.close()

    def _next_out(self) -> tuple[int | None, torch.Tensor | None]:
        out = next(self._out, None)
        if out is None:
            return None, None
        assert self.outgoing is not None  # messages only with an outgoing side (`__init__`)
        return self.outgoing.to, out

    def receive(self, sender: int, size: int) -> Iterator[memoryview]:
        """The `size` bytes of the next file from `sender`, a message at a time (each in a buffer
        of its own: the hash thread may still hold the previous one), one outgoing message sent
        with each."""
        for n in messages(size):
            to, out = self._next_out()
            into = torch.empty(n, dtype=torch.uint8)
            _swap(self.group, to, out, sender, into)
            yield memoryview(into.numpy())  # type: ignore[arg-type]  # numpy's stubs, as tensorfile's

    def send_rest(self) -> None:
        """Send the outgoing messages not sent yet, alone."""
        while (sent := self._next_out())[1] is not None:
            _swap(self.group, *sent, None, None)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


_Into = TypeVar("_Into", bound="torch.Tensor | None")  # what `_swap` receives into, and returns


def _swap(group: Any, to: int | None, out: torch.Tensor | None, sender: int | None, into: _Into) -> _Into:
    """Send `out` to rank `to` and receive `into` from rank `sender` at once (either side None:
    not that direction; an empty tensor travels as nothing, both partners know its size);
    returns `into`, filled."""
    works = []
    if to is not None and out is not None and out.numel():
        works.append(dist.isend(out, to, group=group))
    if sender is not None and into is not None and into.numel():
        works.append(dist.irecv(into, sender, group=group))
    for work in works:
        assert work is not None  # None only for a rank outside `group`, which holds every rank
        work.wait()
    return into


class PeerCopyFailed(RuntimeError):
    """A background exchange failed other than by a damaged copy (the partner died or timed out,
    a disk error); the original exception is its `__cause__`."""


class PeerCopies:
    """This rank's side of the peer copies of the run `run_id` at a `jump` > 0 (`peer_jump`):
    after each local save, `start` sends the new checkpoint to rank (rank + jump) mod world and
    commits the one of rank (rank - jump) mod world in `store`, in the background (module
    docstring). Made by every rank at the same point (it makes the group). `delay_s` sleeps
    before each exchange: a test hook that widens the window in which one is in flight (config
    `debug.persist_delay_s`).

    Failures. A copy that arrives damaged is logged and dropped (`exchange`). Any other failure
    is logged as a warning by the next `wait`, and this rank's peer copies stop for the rest of
    the process: a failure half-way leaves messages of the pair unmatched, so a later exchange
    could not be framed. Its partners then fail at their next exchange, left waiting for
    PEER_TIMEOUT_S (their next local save waits for that once), and stop too. Training goes on
    either way: a peer copy is a spare (the owner keeps its original, the persistent tier is
    untouched), and a partner that died also fails the training collectives, which end the run
    on their own."""

    def __init__(self, section: LocalTierSection, run_id: str, jump: int, delay_s: float = 0.0) -> None:
        rank, world = distributed.rank(), distributed.world()
        self.to, self.owner = (rank + jump) % world, (rank - jump) % world
        self.delay_s = delay_s
        self.store = peer_store(section, run_id, self.owner)
        self.job = BackgroundJob("peer-copy", "the peer copy", failed=self._failed)
        self.stopped = False
        peer_group()

    def start(self, source: CheckpointStore, step: int) -> None:
        """Exchange this rank's local checkpoint `step` (committed in `source`) in the background;
        the previous exchange must be over (`wait`). Nothing once the copies stopped."""
        if not self.stopped:
            self.job.start(step, self.exchange, source, step)

    def exchange(self, source: CheckpointStore, step: int) -> None:
        """Send this rank's local checkpoint `step` (committed in `source`), receive and commit the
        owner's. A copy that arrives damaged is logged and dropped, and training goes on: a peer
        copy is a spare, its owner still has the original."""
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            transfer(Outgoing(self.to, source, source.ref(step)), Incoming(self.owner, self.store))
        except CheckpointCorrupt as e:
            log.warning("peer copy dropped", step=step, owner=self.owner, problem=str(e)[:300])

    def wait(self) -> float:
        """Wait until no exchange is in flight (at most PEER_TIMEOUT_S per message, the group's
        timeout); a failed one is logged and stops the copies (class docstring). Returns the
        seconds waited."""
        t0 = time.perf_counter()
        try:
            self.job.finish()
        except PeerCopyFailed as e:
            log.warning("peer copies stopped: an exchange failed; training goes on without them", step=self.job.step,
                        to=self.to, owner=self.owner, error=str(e)[:300])
            self.stopped = True
        return time.perf_counter() - t0

    def close(self) -> None:
        """On an error exit: `wait`, but at most CLOSE_WAIT_S; an exchange still running then is
        left to its daemon thread (logged), so the error being raised ends the process."""
        if self.job.wait(CLOSE_WAIT_S):
            self.wait()
        else:
            log.warning("peer copy abandoned at an error exit", step=self.job.step, waited_s=CLOSE_WAIT_S)

    def _failed(self, step: int, e: BaseException) -> PeerCopyFailed:
        return PeerCopyFailed(f"the peer exchange of step {step} failed: {type(e).__name__}: {e}")
