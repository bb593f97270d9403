"""Finding a run dir's committed checkpoints without reading their data; imports no torch.

Layout: `RUN_DIR/checkpoints/step-00001200/` (`CHECKPOINTS_DIR`, `STEP_DIR`; a local save writes
into `step-N.tmp-<writer>-<random>/` first, `TMP_DIR`). A `CheckpointRef` names one step folder.
* `scan(loc)`: the committed refs (a manifest exists) oldest first, and the folders that are not
  checkpoints, from one recursive listing;
* `candidates(loc)`: the committed refs newest first, step folders without a manifest logged;
* `read_manifest(loc, ref)`: the parsed manifest, `CheckpointCorrupt` when missing or malformed;
* `check_sizes(loc, ref)`: the problems that show without reading data (the manifest, each file
  it lists present at its recorded size); verifying digests and headers is loading.py's;
* `latest_committed(loc)`: the newest candidate without such problems.
A process that only watches a run (the supervisor's progress probe) uses this module alone and
so never imports torch (three CPU-seconds and about 200 MiB for the life of the supervisor).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass

from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES, FileRecord, Manifest, parse_manifest
from harness.errors import StorageError
from harness.log import get_logger
from harness.storage.location import Location, folder_name, read_bytes

log = get_logger(__name__)

CHECKPOINTS_DIR = "checkpoints"
STEP_DIR = re.compile(r"step-(\d{8,})")
TMP_DIR = re.compile(r"step-(\d{8,})\.tmp-(.+)-[0-9a-f]{8}")


@dataclass(frozen=True, order=True)
class CheckpointRef:
    """One checkpoint folder: its step, its path in the store's filesystem, its URL for messages."""

    step: int
    path: str
    url: str


def checkpoints_dir(loc: Location) -> str:
    """The folder of a run dir's checkpoints."""
    return loc.join(CHECKPOINTS_DIR)


def ref_at(loc: Location, step: int) -> CheckpointRef:
    """The ref of step `step`'s folder (whether or not it exists)."""
    path = f"{checkpoints_dir(loc)}/step-{step:08d}"
    return CheckpointRef(step, path, loc.url_of(path))


def scan(loc: Location) -> tuple[list[CheckpointRef], list[str]]:
    """(committed refs oldest first, paths of the folders that are not checkpoints: temporary
    folders and step folders without manifest), from one recursive listing of the checkpoints
    folder (on an object store one request per 1,000 objects; a manifest check per step folder
    was one request each)."""
    # Listings are cached per filesystem instance, and fsspec shares one instance per URL and
    # options across a process: without this, a long-lived reader (the supervisor polling the
    # newest checkpoint of its child) would keep seeing the checkpoints of its first look.
    loc.fs.invalidate_cache()
    folder = checkpoints_dir(loc)
    children, manifests = set(), set()
    for path in loc.fs.find(folder, withdirs=True):
        inside = path[len(folder) + 1:].split("/") if path.startswith(folder + "/") else []
        if len(inside) == 1:
            children.add(inside[0])
        elif inside[1:] == [MANIFEST_FILE]:
            manifests.add(inside[0])
    committed, incomplete = [], []
    for name in sorted(children):
        step = STEP_DIR.fullmatch(name)
        if step and name in manifests:
            committed.append(ref_at(loc, int(step[1])))
        elif step or TMP_DIR.fullmatch(name):
            incomplete.append(f"{folder}/{name}")
    return committed, incomplete


def candidates(loc: Location) -> list[CheckpointRef]:
    """Committed checkpoints newest first, not yet verified; step folders without a manifest
    (interrupted saves) are logged as ignored."""
    committed, incomplete = scan(loc)
    for path in incomplete:
        if STEP_DIR.fullmatch(folder_name(path)):
            log.warning("ignoring a checkpoint folder without manifest (an interrupted save?)", path=loc.url_of(path))
    log.debug("checkpoint candidates, newest first", url=loc.url, steps=[r.step for r in committed[::-1]])
    return committed[::-1]


def read_manifest(loc: Location, ref: CheckpointRef) -> Manifest:
    """The parsed manifest of `ref`; `CheckpointCorrupt` when it is missing or malformed.

    Starts with a fresh listing of the checkpoint's folder, which an object store's filesystem
    keeps: what the reads of this checkpoint then ask about its files (present? how large?)
    is answered from that listing, not by a request per file and question (three HEADs per
    file on S3 before)."""
    with suppress(FileNotFoundError):  # no folder: no manifest, said below
        loc.fs.ls(ref.path, detail=False, refresh=True)
    path = f"{ref.path}/{MANIFEST_FILE}"
    if not loc.fs.exists(path):
        raise CheckpointCorrupt(f"{ref.url}: no {MANIFEST_FILE}, so this is not a committed checkpoint "
                                "(an interrupted save?)")
    try:
        manifest = parse_manifest(read_bytes(loc, path, MAX_MANIFEST_BYTES), loc.url_of(path))
    except CheckpointCorrupt:
        raise
    except StorageError as e:
        raise CheckpointCorrupt(str(e)) from e
    if manifest.step != ref.step:
        raise CheckpointCorrupt(f"{ref.url}: the manifest says step {manifest.step}, the folder says {ref.step}")
    return manifest


def check_sizes(loc: Location, ref: CheckpointRef) -> list[str]:
    """The problems of `ref` that show without reading its data: a missing or malformed
    manifest, a file it lists missing or of another size. Costs the manifest's read and one
    listing of the folder; the digests and headers that `loading.verify_files` also checks need
    every byte."""
    try:
        manifest = read_manifest(loc, ref)
    except StorageError as e:
        return [str(e)]
    sizes = {folder_name(entry["name"]): entry["size"] for entry in loc.fs.ls(ref.path, detail=True)}
    return [size_problem(loc.url_of(f"{ref.path}/{rec.name}"), rec, sizes.get(rec.name))
            for rec in manifest.files if sizes.get(rec.name) != rec.size]


def size_problem(where: str, rec: FileRecord, size: int | None) -> str:
    """The message for a file of the manifest found at another size (None: not found)."""
    if size is None:
        return f"{where}: missing (the manifest lists {rec.size} bytes)"
    return f"{where}: {size} bytes, the manifest says {rec.size}"


def skipped(ref: CheckpointRef, problems: list[str]) -> None:
    """Log why the checkpoint `ref` is passed over."""
    for problem in problems:
        log.warning("skipping a checkpoint that fails verification", step=ref.step, problem=problem)


def first_without_problems(refs: Iterable[CheckpointRef],
                           problems_of: Callable[[CheckpointRef], list[str]]) -> CheckpointRef | None:
    """The first of `refs` for which `problems_of` finds none; the others are logged and skipped."""
    for ref in refs:
        problems = problems_of(ref)
        if not problems:
            return ref
        skipped(ref, problems)
    return None


def latest_committed(loc: Location) -> CheckpointRef | None:
    """The newest checkpoint whose files are all there at the sizes its manifest records, found
    without reading their data: one listing and one manifest per candidate. For watching a run's
    progress; a resume still verifies every byte. None if none."""
    return first_without_problems(candidates(loc), lambda ref: check_sizes(loc, ref))
