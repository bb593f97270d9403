"""One writer per run dir: `lease.json` names the owner, its host and pid, and a heartbeat.

A second writer is refused with a message naming the holder. The lease is taken over without
being asked only when the holder is provably gone: its pid is dead on this same host, or its
heartbeat is older than `stale_after_s` (a lost node never heartbeats again). Otherwise the
user decides, with `takeover=True` (`--takeover`).

Trade-off: on local disk a new lease is created with O_EXCL, so two writers starting at once
cannot both win. Object stores have no portable create-if-absent, so there the writer writes,
reads back, and gives up if someone else's id is in the file: this catches all but a race in
the same few milliseconds, which the heartbeat check (`check`) then catches at the next commit.
The clock, host name and pid probe are injectable so tests are exact.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable

import psutil

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.storage import Location, fsync_dir, read_bytes, rename, write_small
from harness.log import get_logger

log = get_logger(__name__)

LEASE_FILE = "lease.json"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Lease:
    """The single-writer lease on the run dir at `loc`, held (or not) by `owner`."""

    def __init__(self, loc: Location, owner: str, *, clock: Callable[[], float] = time.time,
                 host: str | None = None, pid: int | None = None,
                 pid_alive: Callable[[int], bool] = psutil.pid_exists, stale_after_s: float = 1800.0) -> None:
        self.loc, self.owner, self.clock = loc, owner, clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.pid_alive, self.stale_after_s = pid_alive, stale_after_s
        self.path = loc.join(LEASE_FILE)
        self.held = False
        self._since = 0.0
        self._last_beat = 0.0

    def read(self) -> dict | None:
        """The current lease record, or None. A malformed one is reported and treated as absent."""
        if not self.loc.fs.exists(self.path):
            return None
        try:
            doc = json.loads(read_bytes(self.loc, self.path, 1 << 20))
            if isinstance(doc, dict) and all(k in doc for k in ("owner", "host", "pid", "since", "heartbeat")):
                return doc
        except (ValueError, CheckpointError):
            pass
        log.warning("ignoring a malformed lease file", path=self.loc.url_of(self.path))
        return None

    def describe(self, holder: dict) -> str:
        age = self.clock() - float(holder["heartbeat"])
        return (f"writer {holder['owner']} (host {holder['host']}, pid {holder['pid']}, since "
                f"{_iso(float(holder['since']))}, last heartbeat {age:.0f}s ago)")

    def acquire(self, takeover: bool = False) -> None:
        """Take the lease, or raise `CheckpointError` naming the live holder."""
        for _ in range(2):  # a second round only after losing an O_EXCL race
            holder = self.read()
            if holder is not None and holder["owner"] != self.owner:
                gone = self.gone_reason(holder)
                if gone is None and not takeover:
                    raise CheckpointError(
                        f"run dir {self.loc.url} is leased to {self.describe(holder)}; stop that process, "
                        f"or pass --takeover if it is dead"
                    )
                log.warning("taking over the run dir lease", holder=self.describe(holder),
                            reason=gone or "takeover requested")
            self._since = self.clock()
            # A lease file that exists but does not parse is a writer that died between creating
            # and writing it (found by `harness torture`): replace it, as a dead holder's would be.
            if self._write(exclusive=holder is None and not self.loc.fs.exists(self.path)):
                break
        self.check()
        self.held = True

    def heartbeat(self, min_interval_s: float | None = None) -> None:
        """Refresh the heartbeat; cheap to call every step (writes at most every `min_interval_s`,
        default a tenth of `stale_after_s`). Raises `CheckpointError` if the lease was taken over."""
        if not self.held:
            return
        now = self.clock()
        if now - self._last_beat < (self.stale_after_s / 10 if min_interval_s is None else min_interval_s):
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
        """Give the lease up (only if this owner still holds it)."""
        if self.held:
            holder = self.read()
            if holder is not None and holder["owner"] == self.owner:
                self.loc.fs.rm(self.path)
            self.held = False

    def gone_reason(self, holder: dict) -> str | None:
        """Why the holder is provably not writing any more, or None if it may be alive."""
        if holder["host"] == self.host and not self.pid_alive(int(holder["pid"])):
            return f"pid {holder['pid']} is not running on this host"
        age = self.clock() - float(holder["heartbeat"])
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f}s (more than {self.stale_after_s:.0f}s)"
        return None

    def _write(self, exclusive: bool) -> bool:
        """Write our record; with `exclusive` on local disk, False if someone created it first."""
        now = self.clock()
        data = json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid,
                           "since": self._since, "heartbeat": now}, indent=1).encode()
        self._last_beat = now
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
