"""Fault injection under the checkpoint store, for the crash-consistency torture (verify/torture_sweep.py).

`FaultyFileSystem` wraps the filesystem that `open_filesystem` built (local disk, `memory://`,
S3) and counts every storage operation the store makes: open, write, flush, fsync, fsync_dir,
rename, mkdir, put, delete, list. At operation number N (1-based, counted per wrapper, before
the operation runs) it does what the plan's mode says:

* `kill`: SIGKILL of this process, as an OOM kill or a lost node would.
* `powerloss` (local disk): first make the disk look as it would after a power cut (below), then
  SIGKILL. Even N: un-fsynced data is dropped and directory changes not followed by an fsync of
  their folder are undone. Odd N: un-fsynced files keep only the first half of what was written,
  and every directory change persists (a journaled filesystem that orders metadata).
* `crash`: an in-process stand-in for `kill`, for stores that live in this process
  (`memory://`): raise `SimulatedCrash` and refuse every later operation of this wrapper, so no
  cleanup handler can touch the store and no open file is closed (or uploaded) any more.
* `eio`, `enospc`, `transient` (a connection reset, what the retry layer calls transient),
  `permanent` (EACCES): raise that error once; later operations succeed.
* `count`: never fire; `trace` lists (number, operation, path) for choosing points, and with
  `HARNESS_FAULTS_TRACE=FILE` each operation is also appended to FILE as "number op path" (how
  a test picks a point inside a `harness train` process).

The power-loss model tracks, by inode, the last fsynced content of every file written through
the wrapper, and the creations and renames not yet covered by an fsync of their folder. What it
does not model: unlinks are durable at once (a removal that reappears after a crash would only
bring back data the store had decided to drop), reordering of data between files, and the
torn sector inside a write: a "torn" file is a prefix of what was written.

Enabled only by tests and by `harness torture` (storage option `faults`), or by the debug
environment variable `HARNESS_FAULTS=MODE@N` (filesystem.py), never by default.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from _typeshed import HasFileno

OPERATIONS = ("open", "write", "flush", "fsync", "fsync_dir", "rename", "mkdir", "put", "delete", "list")
TRACE_ENV = "HARNESS_FAULTS_TRACE"
MODES = ("kill", "powerloss", "crash", "eio", "enospc", "transient", "permanent", "count")


class SimulatedCrash(BaseException):
    """The "process" died at a storage operation (`crash` mode). A BaseException, like the
    SystemExit of a real death, so `except Exception` in the code under test does not swallow it."""


@dataclass(frozen=True)
class FaultPlan:
    """`mode` at operation number `at` (1-based)."""

    mode: str
    at: int = 0

    @classmethod
    def parse(cls, spec: str | FaultPlan) -> FaultPlan:
        """`"kill@17"`, `"eio@3"`, `"count"`; ValueError naming the accepted forms otherwise."""
        if isinstance(spec, FaultPlan):
            return spec
        mode, _, at = str(spec).strip().partition("@")
        if mode not in MODES or (mode != "count" and not at.isdigit()) or (at and not at.isdigit()):
            raise ValueError(f"fault spec {spec!r}: use MODE@N with MODE one of {', '.join(MODES[:-1])} "
                             f"and N >= 1 the storage operation to fail, or 'count'")
        return cls(mode, int(at or 0))

    def __str__(self) -> str:
        return f"{self.mode}@{self.at}" if self.mode != "count" else "count"


@dataclass
class Injector:
    """The operation counter and what happens at the plan's point; shared by a wrapper's files."""

    plan: FaultPlan
    count: int = 0
    dead: bool = False
    trace: list[tuple[int, str, str]] = field(default_factory=list)
    disk: PowerLossModel | None = None
    open_files: list[Any] = field(default_factory=list)  # the wrapped filesystem's files (fsspec: untyped)
    trace_to: str | None = None

    def hit(self, op: str, path: object) -> None:  # a path, or the list of them an fsspec call takes
        if self.dead:
            raise SimulatedCrash(f"storage operation {op} {path} after the simulated crash")
        self.count += 1
        self.trace.append((self.count, op, str(path)))
        if self.trace_to:
            with open(self.trace_to, "a") as f:
                f.write(f"{self.count} {op} {path}\n")
        if self.count == self.plan.at:
            self._fire(op, str(path))

    def _fire(self, op: str, path: str) -> None:
        mode, what = self.plan.mode, f"injected at storage operation {self.count} ({op} {path})"
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "powerloss":
            if self.disk is not None:
                self.disk.power_loss(torn=self.count % 2 == 1)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "crash":
            self.dead = True
            for f in self.open_files:  # a dead process never closes (uploads) what it had open
                try:
                    f.closed = True
                except AttributeError:
                    pass
            raise SimulatedCrash(what)
        if mode == "eio":
            raise OSError(errno.EIO, f"Input/output error ({what})")
        if mode == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device ({what})")
        if mode == "transient":
            raise ConnectionResetError(errno.ECONNRESET, f"Connection reset by peer ({what})")
        if mode == "permanent":
            raise PermissionError(errno.EACCES, f"Access denied ({what})")


def wrap_filesystem(fs: Any, spec: str | FaultPlan) -> FaultyFileSystem:
    """`fs` with the fault plan `spec` (see `FaultPlan.parse`)."""
    plan = FaultPlan.parse(spec)
    disk = PowerLossModel() if getattr(fs, "local_disk", False) else None
    return FaultyFileSystem(fs, Injector(plan, disk=disk, trace_to=os.environ.get(TRACE_ENV)))


class FaultyFileSystem:
    """Counts and fails the storage operations of `fs`; everything else is `fs`'s own. (`fs` and
    its files are fsspec's, which has no type information: what they return is `Any` here.)"""

    def __init__(self, fs: Any, injector: Injector) -> None:
        self.fs, self.injector = fs, injector

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def _hit(self, op: str, path: object) -> None:
        self.injector.hit(op, path)

    # ---- files -----------------------------------------------------------------------------

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> _FaultyFile:
        self._hit("open", path)
        disk = self.injector.disk if "r" not in mode else None
        before = disk.before_write(path) if disk else None
        f = self.fs.open(path, mode, **kwargs)
        if disk:
            disk.after_open(path, f, before)
        return self._file(f, path, mode)

    def create_new(self, path: str) -> _FaultyFile:
        self._hit("open", path)
        f = self.fs.create_new(path)
        if self.injector.disk:
            self.injector.disk.after_open(path, f, None)
        return self._file(f, path, "xb")

    def _file(self, f: Any, path: str, mode: str) -> _FaultyFile:
        if "r" in mode:
            return _FaultyFile(f, self.injector, path, put=False)
        self.injector.open_files.append(f)
        return _FaultyFile(f, self.injector, path, put=not getattr(self.fs, "local_disk", False))

    def fsync(self, f: _FaultyFile) -> None:
        f.flush()
        self._hit("fsync", f.path)
        self.fs.fsync(f.f)
        if self.injector.disk:
            self.injector.disk.synced(f.f)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> Any:
        self._hit("put", path)
        return self.fs.pipe_file(path, value, **kwargs)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> Any:
        self._hit("put", rpath)
        return self.fs.put_file(lpath, rpath, **kwargs)

    # ---- folders and names -----------------------------------------------------------------

    def fsync_dir(self, path: str) -> None:
        self._hit("fsync_dir", path)
        self.fs.fsync_dir(path)
        if self.injector.disk:
            self.injector.disk.dir_synced(path)

    def replace(self, src: str, dst: str) -> None:
        self._hit("rename", f"{src} -> {dst}")
        backup = self.injector.disk.before_rename(dst) if self.injector.disk else None
        self.fs.replace(src, dst)
        if self.injector.disk:
            self.injector.disk.renamed(src, dst, backup)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> Any:
        self._hit("rename", f"{path1} -> {path2}")
        return self.fs.mv(path1, path2, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._hit("mkdir", path)
        new = self.injector.disk.missing_dirs(path) if self.injector.disk else []
        self.fs.makedirs(path, exist_ok=exist_ok)
        if self.injector.disk:
            self.injector.disk.created(new)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._hit("mkdir", path)
        new = self.injector.disk.missing_dirs(path) if self.injector.disk else []
        self.fs.mkdir(path, create_parents=create_parents, **kwargs)
        if self.injector.disk:
            self.injector.disk.created(new)

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> Any:
        self._hit("delete", path)
        return self.fs.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> Any:
        self._hit("delete", path)
        return self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        self._hit("delete", path)
        self.fs.remove_tree(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._hit("list", path)
        return self.fs.ls(path, detail=detail, **kwargs)

    def find(self, path: str, **kwargs: Any) -> Any:
        self._hit("list", path)
        return self.fs.find(path, **kwargs)


class _FaultyFile:
    """A file of a `FaultyFileSystem`: counts write and flush; closing an object-store file is
    its upload (`put`). After a simulated crash it neither writes nor closes."""

    def __init__(self, f: Any, injector: Injector, path: str, put: bool) -> None:
        self.f, self.injector, self.path, self.put = f, injector, str(path), put

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def write(self, data: bytes) -> Any:
        self.injector.hit("write", self.path)
        return self.f.write(data)

    def flush(self) -> Any:
        self.injector.hit("flush", self.path)
        return self.f.flush()

    def close(self) -> None:
        if self.injector.dead:
            return
        if self.put and not self.f.closed:
            self.injector.hit("put", self.path)
        self.f.close()

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.f)


# The events of PowerLossModel.pending: ("create", path) and ("rename", src, dst, the content dst had).
_Created = tuple[Literal["create"], str]
_Renamed = tuple[Literal["rename"], str, str, bytes | None]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class PowerLossModel:
    """What a power cut would take away from a local disk: the bookkeeping of `powerloss` mode.

    `unsynced`: inode -> the file's last durable content (None: never fsynced, so empty).
    `pending`: creations and renames whose folder has not been fsynced since, oldest first.
    """

    def __init__(self) -> None:
        self.unsynced: dict[int, bytes | None] = {}
        self.pending: list[_Created | _Renamed] = []
        self.seen: set[str] = set()

    def before_write(self, path: str) -> tuple[int, bytes] | None:
        path = os.path.abspath(path)
        if os.path.isfile(path):
            return os.stat(path).st_ino, _read(path)
        return None

    def after_open(self, path: str, f: HasFileno, before: tuple[int, bytes] | None) -> None:
        path = os.path.abspath(path)
        self.seen.add(os.path.dirname(path))
        ino = os.fstat(f.fileno()).st_ino
        if before is None:
            self.unsynced.setdefault(ino, None)
            self.pending.append(("create", path))
        else:
            self.unsynced.setdefault(ino, before[1])

    def synced(self, f: HasFileno) -> None:
        self.unsynced.pop(os.fstat(f.fileno()).st_ino, None)

    def missing_dirs(self, path: str) -> list[str]:
        out, path = [], os.path.abspath(path)
        while not os.path.exists(path):
            out.append(path)
            path = os.path.dirname(path)
        return out[::-1]

    def created(self, dirs: list[str]) -> None:
        for d in dirs:
            self.seen.add(os.path.dirname(d))
            self.pending.append(("create", d))

    def before_rename(self, dst: str) -> bytes | None:
        dst = os.path.abspath(dst)
        return _read(dst) if os.path.isfile(dst) else None

    def renamed(self, src: str, dst: str, replaced: bytes | None) -> None:
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        self.seen.update({os.path.dirname(src), os.path.dirname(dst)})
        self.pending.append(("rename", src, dst, replaced))

    def dir_synced(self, path: str) -> None:
        path = os.path.abspath(path)
        self.pending = [e for e in self.pending if os.path.dirname(e[2] if e[0] == "rename" else e[1]) != path]

    def power_loss(self, torn: bool) -> None:
        """Make the disk look as after a power cut now (see the module docstring)."""
        if not self.seen:
            return
        root = os.path.commonpath(sorted(self.seen))
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                ino = os.stat(path).st_ino
                if ino not in self.unsynced:
                    continue
                data = _read(path)
                data = data[: len(data) // 2] if torn else (self.unsynced[ino] or b"")
                with open(path, "r+b") as f:
                    f.write(data)
                    f.truncate(len(data))
        if torn:
            return
        for event in reversed(self.pending):
            if event[0] == "create" and os.path.lexists(event[1]):
                if os.path.isdir(event[1]):
                    shutil.rmtree(event[1], ignore_errors=True)
                else:
                    os.unlink(event[1])
            elif event[0] == "rename" and os.path.lexists(event[2]) and not os.path.lexists(event[1]):
                os.rename(event[2], event[1])
                if event[3] is not None:
                    with open(event[2], "wb") as f:
                        f.write(event[3])
