"""Local-first persistence: commit to local disk, upload to the run dir in the background.

    commit = LocalFirst(CheckpointStore("s3://bucket/run"), "/scratch/run-ckpt")
    commit(step, snapshot, meta=meta)   # returns once the checkpoint is committed locally
    commit.poll()                       # raises a failed upload, once
    commit.finish()                     # waits until the newest upload is published

A `Committer` (commit.py), so a saver uses it like any other: `commit` writes the checkpoint
with a local `CheckpointStore` (the usual atomic local commit), then a `BackgroundJob`
(background.py) copies it to the remote run dir through the remote store's one commit sequence
(`committing`): every data file, streamed from the local copy, then every uploaded object is
read back and its size and digest checked against the local manifest, and only then the remote
manifest is written listing the same files (the commit point) and remote retention runs. A
process killed or failing before the manifest leaves no new remote checkpoint: the previous one
stays the newest good one, and discovery skips the manifest-less folder exactly as it does
after an interrupted direct save.

One upload in flight: a commit that arrives while one uploads waits for it first (it is also
what keeps the local copy being uploaded safe from local retention). A failed upload is kept
and raised by the next `commit`/`poll`/`finish`. The remote is the source of truth: discovery,
reading, loading and the lease are the remote store's, used directly (this is no store); the
local folder only stages uploads and keeps the last `LOCAL_KEEP` checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import Snapshot
from harness.checkpoint.manifest import FileRecord
from harness.checkpoint.save.background import BackgroundJob
from harness.checkpoint.save.commit import Committer
from harness.checkpoint.store import CheckpointStore
from harness.errors import UserError
from harness.log import get_logger
from harness.storage.location import hash_file, open_read

log = get_logger(__name__)

LOCAL_KEEP = 2
_CHUNK = 8 << 20


class UploadError(RuntimeError):
    """A background upload failed with an unexpected error; the original is its `__cause__`."""


class LocalFirst(Committer):
    """Commits to `local_dir` first and publishes each checkpoint on `remote` (the run dir) once
    every uploaded object verified."""

    def __init__(self, remote: CheckpointStore, local_dir: str) -> None:
        super().__init__(remote)
        self.local = CheckpointStore(local_dir, keep_last=LOCAL_KEEP, writer_id=remote.writer_id)
        self.uploads = BackgroundJob("ckpt-upload", "the upload", failed=self._failed)

    def __call__(self, step: int, snapshot: Snapshot, *, meta: Mapping[str, Any] | None = None) -> CheckpointRef:
        """Commit `snapshot` locally and start its upload; returns the remote ref it will have
        (published only when the upload succeeds: `finish` waits for that). Waits for the upload
        in flight first and raises its failure."""
        if self.uploads.busy:
            t0 = time.perf_counter()
            self.uploads.wait()
            log.info("waited for the previous upload before committing", step=step,
                     uploading_step=self.uploads.step, waited_s=round(time.perf_counter() - t0, 3))
        self.uploads.poll()
        for stale in self.local.list():
            if stale.step > step:  # left by a run that went back to an older remote checkpoint
                self.local.delete(stale)
        local_ref = self.local.commit(step, snapshot, meta=meta)
        self.uploads.start(step, self.upload, local_ref)
        return self.store.ref(step)

    def upload(self, local_ref: CheckpointRef) -> CheckpointRef:
        """Copy the local checkpoint `local_ref` to the remote: data files, read-back check of
        every object, then the manifest, then remote retention."""
        files = self.local.manifest(local_ref).files
        with self.store.committing(local_ref.step, uploaded_from=local_ref.url) as commit:
            for rec in files:
                sent = self.store.write_file(commit.work, commit.ref, rec.name, self._chunks(local_ref, rec))
                if sent != rec:
                    raise CheckpointError(f"{local_ref.url}/{rec.name}: the local copy changed ({sent.describe()}; "
                                          f"its manifest says {rec.describe()}); not published")
            problems = self.check_uploaded(commit.work, files)
            if problems:
                raise CheckpointError(f"upload of step {commit.ref.step} to {commit.ref.url} fails verification, not "
                                      f"published: " + "; ".join(problems))
            commit.records += files
        return commit.ref

    def check_uploaded(self, work: str, files: tuple[FileRecord, ...]) -> list[str]:
        """Every uploaded object read back from the remote: problems with its size or digest."""
        problems = []
        loc = self.store.loc
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

    def _failed(self, step: int, e: BaseException) -> Exception:
        """A failed upload as the owner raises it: `CheckpointError` (a `UserError`) when the
        store raised one, else `UploadError`; both name the step."""
        message = (f"the upload of the checkpoint at step {step} to {self.store.url} failed: {e}; it was not "
                   f"published, the previous remote checkpoint is still the newest good one")
        if isinstance(e, UserError):
            return CheckpointError(message)
        return UploadError(f"{message} ({type(e).__name__})")

    def poll(self) -> None:
        """Raise the failure of a finished upload, once."""
        self.uploads.poll()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the upload in flight, at most `timeout` seconds; True when none is left."""
        return self.uploads.wait(timeout)

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the newest checkpoint is published remotely, then raise a failed upload.
        Raises `TimeoutError` if the upload still runs after `timeout` seconds."""
        self.uploads.finish(timeout)

    def close(self) -> None:
        """On an error exit: let a good upload finish, log (not raise) a failed one."""
        self.uploads.close()
