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
backend), point to point: the manifest's length, the manifest, then each file as a byte tensor,
one at a time (memory: the largest file). Sending and receiving run at once (`isend`/`irecv`),
so a ring of ranks that each send and receive cannot deadlock.

In the background (`PeerCopies`): the exchange of a local save runs in a `BackgroundJob`
(background.py) while training goes on. Every rank makes its local saves at the same steps, so
the exchange threads of all ranks run the same sequence of exchanges and partners meet. One
exchange in flight at most: the local tier waits for it (`wait`) before its next local save, a
`drop_after` (a rollback or a resume), and at the end of the run (local_tier.py), so retention
never deletes a checkpoint while it is being sent, memory stays one file each way, and the last
peer copy exists when a run finishes. The exchange uses only the peer group, which is separate
from the training group and from the persistent saver's side group, so its thread and the
training collectives never interleave on one group; the group is made in the main thread, by
every rank at the same point (`PeerCopies()`). Recovery from peer copies is
checkpoint/save/local_recovery.py: it sees committed copies only.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.manifest import MAX_MANIFEST_BYTES, FileRecord, parse_manifest
from harness.checkpoint.save.background import BackgroundJob
from harness.checkpoint.store import CheckpointStore
from harness.config import LocalTierSection
from harness.log import get_logger
from harness.parallel import distributed
from harness.storage.location import folder_name, open_location, open_read
from harness.topology import topology_from_env

log = get_logger(__name__)

PEER = "peer"  # the tier of a resume for which at least one rank's part came from a peer copy
PEER_DIR = re.compile(r"peer-of-rank-(\d{5,})")
# A peer that dies mid-copy must not hold its partner for gloo's default 30 minutes; the hang
# watchdog around the save usually ends the process sooner.
PEER_TIMEOUT_S = 300.0
# On an error exit a partner may be held in a training collective by this very rank and never
# take its side of the exchange in flight: the exit waits this long for it, not PEER_TIMEOUT_S.
CLOSE_WAIT_S = 10.0


def peer_jump(section: LocalTierSection, world: int) -> int:
    """How many ranks away each rank's peer copies go (0: none): `section.peer_jump`, else
    LOCAL_WORLD_SIZE; none at world size 1 or when the jump comes round to the rank itself."""
    jump = topology_from_env().local_world_size if section.peer_jump is None else section.peer_jump
    return jump % world if world > 1 else 0


def peer_store(section: LocalTierSection, run_id: str, owner: int) -> CheckpointStore:
    """The copies of rank `owner`'s local checkpoints that this node's folder holds."""
    return CheckpointStore(f"{section.dir.rstrip('/')}/{run_id}/peer-of-rank-{owner:05d}", keep_last=section.keep)


def peer_stores(section: LocalTierSection, run_id: str) -> dict[int, CheckpointStore]:
    """owner rank -> the store of its copies, for every peer folder of the run `run_id` here."""
    loc = open_location(f"{section.dir.rstrip('/')}/{run_id}")
    with suppress(FileNotFoundError):
        owners = [PEER_DIR.fullmatch(folder_name(p)) for p in loc.fs.ls(loc.root, detail=False)]
        return {int(m[1]): peer_store(section, run_id, int(m[1])) for m in owners if m}
    return {}


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
    that arrived do not match the sender's manifest (nothing is committed then); every file is
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
    sending = mine.files if mine else ()
    if incoming is None:
        _swap_files(group, outgoing, sending, None, (), lambda name, data: None)
        return None
    received = parse_manifest(theirs.numpy().tobytes(), f"the peer copy from rank {sender}")
    store = incoming.store

    with store.committing(received.step, peer_of=sender) as commit:
        _swap_files(group, outgoing, sending, sender, received.files,
                    lambda name, data: commit.records.append(store.write_file(commit.work, commit.ref, name, [data])))
        expected = {r.name: r for r in received.files}
        differ = [r.name for r in commit.records if expected[r.name] != r]
        if differ:
            raise CheckpointCorrupt(f"{commit.ref.url}: the copy from rank {sender} does not match its manifest "
                                    f"({', '.join(differ)})")
    return commit.ref


def _swap_files(group: Any, outgoing: Outgoing | None, sending: tuple[FileRecord, ...], sender: int | None,
                receiving: tuple[FileRecord, ...], keep: Callable[[str, memoryview], None]) -> None:
    """The files `sending` (of `outgoing`) sent and the files `receiving` received from `sender`,
    in manifest order, one file each way at a time; `keep(name, data)` takes each received one."""
    for i in range(max(len(sending), len(receiving))):
        out = _read(outgoing, sending[i]) if i < len(sending) else None
        into = torch.empty(receiving[i].size, dtype=torch.uint8) if i < len(receiving) else None
        _swap(group, None if out is None else outgoing.to, out, sender if into is not None else None, into)
        if into is not None:
            keep(receiving[i].name, memoryview(into.numpy()))


def _read(outgoing: Outgoing, record: FileRecord) -> torch.Tensor:
    """The file `record` of the checkpoint `outgoing.ref` as a byte tensor of the size its manifest
    records: both partners frame the file by that size, so one damaged on this disk to another
    length still travels as one file (cut or padded), and its digest tells the receiver."""
    loc = outgoing.store.loc
    with open_read(loc, f"{outgoing.ref.path}/{record.name}") as f:
        data = f.read(record.size)
    return _tensor(data.ljust(record.size, b"\0"))


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _swap(group: Any, to: int | None, out: torch.Tensor | None, sender: int | None,
          into: torch.Tensor | None) -> torch.Tensor | None:
    """Send `out` to rank `to` and receive `into` from rank `sender` at once (either side None:
    not that direction; an empty tensor travels as nothing, both partners know its size);
    returns `into`, filled."""
    works = []
    if to is not None and out is not None and out.numel():
        works.append(dist.isend(out, to, group=group))
    if sender is not None and into is not None and into.numel():
        works.append(dist.irecv(into, sender, group=group))
    for work in works:
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
        self.section, self.run_id, self.delay_s = section, run_id, delay_s
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

    def stores(self) -> list[CheckpointStore]:
        """Every peer folder of this run on this node (an earlier jump's too)."""
        return list(peer_stores(self.section, self.run_id).values())
