"""One writer per run dir: `lease.json` names the owner, its host, pid and process start time, its
heartbeat interval and its last heartbeat.

Heartbeats come from a thread (`start_heartbeat`), every `heartbeat_s` seconds, so neither a long
training step nor a long save makes a live writer look dead. The lease is *stale* after
`MISSED_HEARTBEATS` intervals without one; the interval is the holder's own, read from the lease,
so a reader with another setting judges every holder by the rhythm it promised. A failure of the
heartbeat thread (the lease was taken over, or the storage did not answer within its retry
deadline) is kept and raised by `poll()`, which the step loop calls between steps.

A holder is taken over without being asked only when it is provably gone:
* on this host, its process is not running: no such pid, a zombie, or a pid reused by another
  process (its start time differs from the one recorded). A process that is exiting (killed, not
  yet torn down) gets `DYING_GRACE_S` to go, then is taken over: it can write nothing any more;
* on any host, its heartbeat is stale (a lost node never heartbeats again).
A holder on another host whose heartbeat is not yet stale may be a writer on a node that was just
lost: `acquire` waits, re-reading the lease, until the heartbeat is stale (take over) or moves
(the holder is alive: refuse). A live holder heartbeats within one interval, so a second writer
started by mistake is refused after at most about `heartbeat_s`; a replacement for a lost node
gets the run after at most the stale time, with no person involved. `takeover=True`
(`--takeover`) takes the lease from any holder.

A storage timeout is never read as a missing or malformed lease: `StorageUnavailable` from the
retry layer passes through `read`, so the process exits with the retryable code instead of
concluding that someone else holds, or nobody holds, the run dir.

Trade-off: on local disk a new lease is created with O_EXCL, so two writers starting at once
cannot both win. Object stores have no portable create-if-absent, so there the writer writes,
reads back, and gives up if someone else's id is in the file: this catches all but a race in
the same few milliseconds, which the heartbeat check (`check`) then catches at the next beat.
The clock, sleep, host name, pid and process probe are injectable so tests are exact.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from harness.checkpoint.errors import CheckpointError
from harness.errors import StorageError
from harness.log import get_logger
from harness.storage.location import Location, fsync_dir, read_bytes, rename, write_small

log = get_logger(__name__)

LEASE_FILE = "lease.json"
# A holder is stale after this many heartbeat intervals without a heartbeat: one late beat (a slow
# storage request) must not lose a live writer its run, a dead one should not block it for long.
MISSED_HEARTBEATS = 4
DEFAULT_HEARTBEAT_S = 30.0
# How long a holder process that is exiting on this host gets to finish before it is taken over.
DYING_GRACE_S = 5.0
_POLL_S = 0.2

Holder = dict[str, Any]  # a lease record, as the lease file holds it (owner, host, pid, since, heartbeat, ...)

ALIVE, DYING, GONE = "alive", "dying", "gone"
_PF_EXITING = 0x4  # task flag (include/linux/sched.h): do_exit() has started
_SIGKILL_BIT = 1 << 8


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def process_state(pid: int, started: float | None) -> str:
    """ALIVE, DYING (exiting or SIGKILL pending) or GONE (no such process, a zombie, or a pid now
    used by a process that started at another time than `started`) for a process on this host."""
    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 0.5:
            return GONE
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return GONE
    except psutil.NoSuchProcess:
        return GONE
    except psutil.AccessDenied:
        return ALIVE
    return DYING if _exiting(pid) else ALIVE


def _exiting(pid: int) -> bool:
    """Linux: the process has begun to exit, or has a SIGKILL it has not acted on yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        if flags & _PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(p & _SIGKILL_BIT for p in pending)
    except (OSError, ValueError, IndexError):
        return False


class Lease:
    """The single-writer lease on the run dir at `loc`, held (or not) by `owner`.

    `heartbeat_s`: how often the holder refreshes the lease; it is stale after
    `MISSED_HEARTBEATS` times that (`checkpoint.lease_heartbeat_s`).
    """

    def __init__(self, loc: Location, owner: str, *, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, host: str | None = None, pid: int | None = None,
                 started: float | None = None, process_alive: Callable[[int, float | None], str] = process_state,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        if heartbeat_s <= 0:
            raise CheckpointError(f"checkpoint.lease_heartbeat_s must be > 0 seconds, got {heartbeat_s}")
        self.loc, self.owner, self.clock, self.sleep = loc, owner, clock, sleep
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.started = started if started is not None or pid is not None else psutil.Process().create_time()
        self.process_alive, self.heartbeat_s = process_alive, heartbeat_s
        self.path = loc.join(LEASE_FILE)
        self.held = False
        self._since = 0.0
        self._beats: threading.Thread | None = None
        # This process's reads and writes of the lease file, one at a time: on S3 a read is a
        # HEAD then a GET conditional on the HEAD's ETag, which fails (412) when the heartbeat
        # thread rewrote the file in between (seen: a background save's commit check failed so).
        self._io = threading.Lock()
        self._stop = threading.Event()
        self._failure: BaseException | None = None

    @property
    def stale_after_s(self) -> float:
        return MISSED_HEARTBEATS * self.heartbeat_s

    def read(self) -> Holder | None:
        """The current lease record, or None. A malformed one is reported and treated as absent;
        a storage failure (`StorageUnavailable`) propagates: it says nothing about the lease."""
        with self._io:
            if not self.loc.fs.exists(self.path):
                return None
            try:
                doc = json.loads(read_bytes(self.loc, self.path, 1 << 20))
                if isinstance(doc, dict) and all(k in doc for k in ("owner", "host", "pid", "since", "heartbeat")):
                    return doc
            except (ValueError, StorageError):
                pass
        log.warning("ignoring a malformed lease file", path=self.loc.url_of(self.path))
        return None

    def describe(self, holder: Holder) -> str:
        age = self.clock() - float(holder["heartbeat"])
        return (f"writer {holder['owner']} (host {holder['host']}, pid {holder['pid']}, since "
                f"{_iso(float(holder['since']))}, last heartbeat {age:.0f}s ago)")

    def stale_after(self, holder: Holder) -> float:
        """Seconds without a heartbeat after which `holder` counts as gone (its own interval)."""
        return MISSED_HEARTBEATS * float(holder.get("heartbeat_s") or self.heartbeat_s)

    def acquire(self, takeover: bool = False) -> None:
        """Take the lease, or raise `CheckpointError` naming the live holder (see the module
        docstring for when this waits first)."""
        for _ in range(2):  # a second round only after losing an O_EXCL race
            holder = self._wait_for_holder() if not takeover else self.read()
            if holder is not None and holder["owner"] != self.owner:
                log.warning("taking over the run dir lease", holder=self.describe(holder),
                            reason=self.gone_reason(holder) or "takeover requested")
            self._since = self.clock()
            # A lease file that exists but does not parse is a writer that died between creating
            # and writing it (found by `harness torture`): replace it, as a dead holder's would be.
            if self._write(exclusive=holder is None and not self.loc.fs.exists(self.path)):
                break
        self.check()
        self.held = True

    def _wait_for_holder(self) -> Holder | None:
        """The lease record once it is free to take (None, ours, or a gone holder's); raises
        `CheckpointError` when the holder is alive."""
        first_beat: object = None
        give_up_at: float | None = None
        while True:
            holder = self.read()
            if holder is None or holder["owner"] == self.owner or self.gone_reason(holder) is not None:
                return holder
            now = self.clock()
            same_host = holder["host"] == self.host
            if first_beat is None:
                first_beat = holder["heartbeat"]
                wait = (DYING_GRACE_S if self._holder_state(holder) == DYING else 0.0) if same_host else \
                    float(holder["heartbeat"]) + self.stale_after(holder) - now
                give_up_at = now + max(wait, 0.0)
                if wait > 0:
                    log.warning("the run dir lease is held by a writer that may be gone; waiting for it",
                                holder=self.describe(holder), wait_s=round(wait, 1))
            assert give_up_at is not None  # set in the round that set first_beat (or in every round, while None)
            moved = holder["heartbeat"] != first_beat
            if moved or now >= give_up_at:
                if same_host and not moved and self._holder_state(holder) == DYING:
                    return holder  # still tearing down after its grace: it can write nothing any more
                raise CheckpointError(
                    f"run dir {self.loc.url} is leased to {self.describe(holder)}; stop that process, "
                    f"or pass --takeover if it is dead")
            self.sleep(min(_POLL_S if same_host else max(self.heartbeat_s / 4, _POLL_S), give_up_at - now))

    def start_heartbeat(self) -> None:
        """Refresh the lease every `heartbeat_s` from a daemon thread until `release`; a failure
        stops the thread and is raised by the next `poll()`."""
        if self._beats is not None or not self.held:
            return
        self._stop.clear()
        self._beats = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.heartbeat()
            except BaseException as e:  # kept for the step loop, which decides how to stop
                self._failure = e
                return

    def poll(self) -> None:
        """Raise the heartbeat thread's failure (lost lease, storage unavailable), once."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def heartbeat(self) -> None:
        """Refresh the heartbeat now. Raises `CheckpointError` if the lease was taken over."""
        if not self.held:
            return
        self.check()
        self._write(exclusive=False)

    def check(self) -> None:
        """Raise `CheckpointError` unless this owner holds the lease on storage right now."""
        holder = self.read()
        if holder is None or holder["owner"] != self.owner:
            self.held = False
            who = "nobody (the lease file is gone)" if holder is None else self.describe(holder)
            raise CheckpointError(
                f"lost the lease on {self.loc.url}: it is now held by {who}; this process must stop "
                f"writing checkpoints there"
            )

    def release(self) -> None:
        """Stop the heartbeats and give the lease up (only if this owner still holds it)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join()
            self._beats = None
        if self.held:
            holder = self.read()
            if holder is not None and holder["owner"] == self.owner:
                self.loc.fs.rm(self.path)
            self.held = False

    def gone_reason(self, holder: Holder) -> str | None:
        """Why the holder is provably not writing any more, or None if it may be alive."""
        if holder["host"] == self.host and self._holder_state(holder) == GONE:
            return f"pid {holder['pid']} is not running on this host"
        age = self.clock() - float(holder["heartbeat"])
        stale = self.stale_after(holder)
        if age >= stale:
            return f"no heartbeat for {age:.0f}s (more than {stale:.0f}s: {MISSED_HEARTBEATS} missed heartbeats)"
        return None

    def _holder_state(self, holder: Holder) -> str:
        started = holder.get("started")
        return self.process_alive(int(holder["pid"]), None if started is None else float(started))

    def _write(self, exclusive: bool) -> bool:
        """Write our record; with `exclusive` on local disk, False if someone created it first."""
        with self._io:
            return self._write_record(exclusive)

    def _write_record(self, exclusive: bool) -> bool:
        now = self.clock()
        data = json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid, "started": self.started,
                           "heartbeat_s": self.heartbeat_s, "since": self._since, "heartbeat": now},
                          indent=1).encode()
        if not self.loc.is_local:
            write_small(self.loc, self.path, data)
            return True
        self.loc.fs.makedirs(self.loc.root, exist_ok=True)
        if exclusive:
            try:
                f = self.loc.fs.create_new(self.path)
            except FileExistsError:
                return False
            with f:
                f.write(data)
                self.loc.fs.fsync(f)
        else:
            tmp = f"{self.path}.tmp-{self.pid}"
            write_small(self.loc, tmp, data)
            rename(self.loc, tmp, self.path)  # readers see the old or the new lease, never half of one
        fsync_dir(self.loc, self.loc.root)
        return True
