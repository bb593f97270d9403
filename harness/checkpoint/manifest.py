"""`manifest.json`: the commit record of a checkpoint, written after every data file.

A checkpoint exists only when its manifest exists, parses, and every file it lists has the
listed size and digest. Each file's entry names its hash algorithm as the key of its digest
(`{"name", "size", "blake3": hex}`; harness/storage/digest.py): version 2, written now, names BLAKE3; version 1
(harness releases before it) named sha256, and such checkpoints are still read and verified. An
older harness refuses a version 2 manifest with a message naming the version, never by
misreading it. The manifest names files, never paths: a listed name must be a plain file name
inside the checkpoint folder, so a hostile manifest (`../x`, `/etc/passwd`) is refused before
anything is opened. The creation time and writer id live here, not in the data files, so the
data files of two saves of the same state are byte-identical.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from harness.checkpoint.errors import CheckpointError
from harness.errors import StorageError
from harness.storage.digest import ALGORITHMS, DEFAULT_ALGORITHM, HEX_DIGITS

MANIFEST_FILE = "manifest.json"
# Every checkpoint's state file (format.py writes it): named here, where a manifest that does not
# list it is refused, so that reading a manifest needs no torch (format.py imports it).
STATE_FILE = "state.json"
MAX_MANIFEST_BYTES = 16 << 20
MANIFEST_VERSION = 2
# Version -> the algorithms its file entries may name (version 1 wrote sha256 only).
READABLE_VERSIONS = {1: ("sha256",), 2: tuple(ALGORITHMS)}
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_DIGEST = re.compile(rf"[0-9a-f]{{{HEX_DIGITS}}}")


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint: its size and its digest under `algorithm` (harness/storage/digest.py)."""

    name: str
    size: int
    digest: str
    algorithm: str = DEFAULT_ALGORITHM

    def describe(self) -> str:
        """`N bytes with blake3 HEX`, for messages comparing a file with its record."""
        return f"{self.size} bytes with {self.algorithm} {self.digest}"


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[FileRecord, ...]
    created: float
    writer: str
    format_version: int = MANIFEST_VERSION

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "created_unix": self.created,
            "writer": self.writer,
            "files": [{"name": f.name, "size": f.size, f.algorithm: f.digest} for f in self.files],
        }
        return json.dumps(doc, indent=1).encode()


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; `CheckpointError` naming `where` on any defect."""
    try:
        doc = json.loads(data.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        version = doc["format_version"]
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where}: manifest format version {version!r}, this harness reads versions "
                f"{sorted(READABLE_VERSIONS)}; use the harness version that wrote it"
            )
        step, created, writer = doc["step"], doc["created_unix"], doc["writer"]
        if type(step) is not int or step < 0 or not isinstance(created, (int, float)) or not isinstance(writer, str):
            raise ValueError("bad step, created_unix or writer")
        files = tuple(_record(r, where, READABLE_VERSIONS[version]) for r in doc["files"])
    except StorageError:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{where}: malformed manifest ({type(e).__name__}: {e}); the checkpoint is not usable"
        ) from e
    names = [f.name for f in files]
    if len(set(names)) != len(names) or STATE_FILE not in names or MANIFEST_FILE in names:
        raise CheckpointError(f"{where}: manifest lists files {names}: duplicates, no {STATE_FILE}, or itself")
    return Manifest(step=step, files=files, created=float(created), writer=writer, format_version=version)


def _record(r: object, where: str, algorithms: tuple[str, ...]) -> FileRecord:
    if not isinstance(r, dict):
        raise ValueError(f"file entry {r!r} is not an object")
    name, size = r["name"], r["size"]
    named = [a for a in algorithms if a in r]
    if len(named) != 1 or len(r) != 3:
        raise ValueError(f"file entry for {name!r} must hold name, size and one digest named by its algorithm "
                         f"({' or '.join(algorithms)}); it holds {sorted(r)}")
    algorithm = named[0]
    digest = r[algorithm]
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise CheckpointError(
            f"{where}: manifest lists {name!r}, which is not a plain file name inside the checkpoint folder; "
            f"refusing the checkpoint (it was not written by this harness)"
        )
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"file entry for {name!r} has a bad size or {algorithm} digest")
    return FileRecord(name, size, digest, algorithm)
