"""Local-first persistence: commit to local disk, upload to the run dir in the background.

    store = LocalFirstStore(CheckpointStore("s3://bucket/run"), "/scratch/run-ckpt")
    store.commit(step, snapshot, meta=meta)   # returns once the checkpoint is committed locally
    store.poll()                              # raises a failed upload, once
    store.finish()                            # waits until the newest upload is published

`commit` writes the checkpoint with a local `CheckpointStore` (the usual atomic local commit),
then a background thread copies it to the remote run dir with the remote store's own split
commit: `begin`, every data file (`write_file`, streamed from the local copy), then every
uploaded object is read back and its size and digest checked against the local manifest, and
only then `seal` writes the remote manifest listing the same files (the commit point) and
remote retention runs. A process killed or failing before the manifest leaves no new remote
checkpoint: the previous one stays the newest good one, and discovery skips the manifest-less
folder exactly as it does after an interrupted direct save.

One upload in flight: a commit that arrives while one uploads waits for it first (it is also
what keeps the local copy being uploaded safe from local retention). A failed upload is kept
and raised by the next `commit`/`poll`/`finish`. The remote is the source of truth: discovery,
reading, loading and the lease are the remote store's (every other attribute is delegated to
it); the local folder only stages uploads and keeps the last `LOCAL_KEEP` checkpoints.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import Snapshot, capture
from harness.checkpoint.manifest import FileRecord
from harness.checkpoint.storage import hash_file, open_read
from harness.checkpoint.store import CheckpointRef, CheckpointStore
from harness.errors import UserError
from harness.log import get_logger

log = get_logger(__name__)

LOCAL_KEEP = 2
_CHUNK = 8 << 20
# The split commit writes straight to the remote, bypassing the local copy: not offered here.
_SPLIT_COMMIT = frozenset({"begin", "write_file", "seal", "discard"})


class UploadError(RuntimeError):
    """A background upload failed with an unexpected error; the original is its `__cause__`."""


class LocalFirstStore:
    """A `CheckpointStore`'s trainer-facing surface, committing to `local_dir` first and
    publishing each checkpoint on `remote` once every uploaded object verified."""

    def __init__(self, remote: CheckpointStore, local_dir: str) -> None:
        self.remote = remote
        self.local = CheckpointStore(local_dir, keep_last=LOCAL_KEEP, writer_id=remote.writer_id)
        self._thread: threading.Thread | None = None
        self._uploading: int | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name in _SPLIT_COMMIT:
            raise AttributeError(f"LocalFirstStore has no {name}: several ranks commit straight to the run dir")
        return getattr(self.remote, name)

    @property
    def url(self) -> str:
        return self.remote.url

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- writing ---------------------------------------------------------------------------

    def save(self, step: int, parts: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        return self.commit(step, capture(parts), meta=meta)

    def commit(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        """Commit `snapshot` locally and start its upload; returns the remote ref it will have
        (published only when the upload succeeds: `finish` waits for that). Waits for the upload
        in flight first and raises its failure."""
        if self.busy:
            t0 = time.perf_counter()
            self.wait()
            log.info("waited for the previous upload before committing", step=step,
                     uploading_step=self._uploading, waited_s=round(time.perf_counter() - t0, 3))
        self.poll()
        for stale in self.local.list():
            if stale.step > step:  # left by a run that went back to an older remote checkpoint
                self.local.delete(stale)
        local_ref = self.local.commit(step, snapshot, meta=meta)
        self._uploading = step
        self._thread = threading.Thread(target=self._upload_in_background, args=(local_ref,),
                                        name=f"ckpt-upload-{step}", daemon=True)
        self._thread.start()
        return self.remote.ref(step)

    def _upload_in_background(self, local_ref: CheckpointRef) -> None:
        try:
            self.upload(local_ref)
        except BaseException as e:  # kept for the next commit/poll/finish
            self._failure = (local_ref.step, e)

    def upload(self, local_ref: CheckpointRef) -> CheckpointRef:
        """Copy the local checkpoint `local_ref` to the remote: data files, read-back check of
        every object, then the manifest, then remote retention."""
        t0 = time.perf_counter()
        files = self.local.manifest(local_ref).files
        ref, work = self.remote.begin(local_ref.step)
        try:
            for rec in files:
                sent = self.remote.write_file(work, ref, rec.name, self._chunks(local_ref, rec))
                if sent != rec:
                    raise CheckpointError(f"{local_ref.url}/{rec.name}: the local copy changed ({sent.describe()}; "
                                          f"its manifest says {rec.describe()}); not published")
            problems = self.check_uploaded(work, files)
            if problems:
                raise CheckpointError(f"upload of step {ref.step} to {ref.url} fails verification, not published: "
                                      + "; ".join(problems))
            self.remote.seal(ref, work, list(files))
        except BaseException:
            self.remote.discard(work)
            raise
        log.info("checkpoint uploaded", step=ref.step, url=ref.url, bytes=sum(r.size for r in files),
                 seconds=round(time.perf_counter() - t0, 3))
        self.remote.gc(newest_good=ref.step)
        return ref

    def check_uploaded(self, work: str, files: tuple[FileRecord, ...]) -> list[str]:
        """Every uploaded object read back from the remote: problems with its size or digest."""
        problems = []
        loc = self.remote.loc
        for rec in files:
            path = f"{work}/{rec.name}"
            found = FileRecord(rec.name, *hash_file(loc, path, rec.algorithm), rec.algorithm)
            if found != rec:
                problems.append(f"{loc.url_of(path)}: {found.describe()}, expected {rec.describe()}")
        return problems

    def _chunks(self, local_ref: CheckpointRef, rec: FileRecord) -> Iterator[bytes]:
        with open_read(self.local.loc, f"{local_ref.path}/{rec.name}") as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    # ---- waiting ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Raise the failure of a finished upload, once: `CheckpointError` (a `UserError`) when
        the store raised one, else `UploadError`; both name the step."""
        with self._lock:
            if self._failure is None or self.busy:
                return
            step, e = self._failure
            self._failure = None
        message = (f"the upload of the checkpoint at step {step} to {self.remote.url} failed: {e}; it was not "
                   f"published, the previous remote checkpoint is still the newest good one")
        if isinstance(e, UserError):
            raise CheckpointError(message) from e
        raise UploadError(f"{message} ({type(e).__name__})") from e

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the upload in flight, at most `timeout` seconds; True when none is left."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the newest checkpoint is published remotely, then raise a failed upload.
        Raises `TimeoutError` if the upload still runs after `timeout` seconds."""
        if not self.wait(timeout):
            raise TimeoutError(f"the upload of step {self._uploading} is still running after {timeout}s")
        self.poll()

    def close(self) -> None:
        """On an error exit: let a good upload finish, log (not raise) a failed one."""
        self.wait()
        try:
            self.poll()
        except Exception as e:  # noqa: BLE001 - reported, not raised: the propagating error stays the one shown
            log.error("checkpoint upload failed during an error exit", error=str(e))
