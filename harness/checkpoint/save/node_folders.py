"""What one node's local tier holds of a run: the folders under `DIR/<run id>/` (`folders`) and which
ranks see the same ones (`disk_id`).

Rank r keeps its local checkpoints in `rank-NNNNN` (NNNNN: r) and the peer copies it receives of
rank o's in `peer-of-rank-OOOOO` (checkpoint/save/peer_copies.py). A folder's name says whose
copies it holds (its owner, checked against each copy's state.json: local_tier.not_mine), never
which process wrote them: a node whose rank changed (a world that shrank, or grew again) keeps
the folders of its earlier ranks beside its new one, and every copy in every one of them is a
candidate for recovery (checkpoint/save/local_recovery.py) and goes with a resume's abandoned
future (local_tier.LocalTier.drop_after).

Several ranks of a node usually share one folder (`DIR` is set per node). `disk_id` names the
storage behind it, so that the ranks learn which of them see the same files whatever path leads
there: each copy is then verified by one of them, and a copy sent there is received once.
"""

from __future__ import annotations

import re
from contextlib import suppress
from dataclasses import dataclass
from secrets import token_hex

from harness.checkpoint.store import CheckpointStore
from harness.config import LocalTierSection
from harness.parallel import distributed
from harness.storage.location import folder_name, fsync_dir, open_location, open_read, rename, write_small

LOCAL = "local"
PEER = "peer"  # the tier of a resume for which at least one rank's part came from a copy of another rank
RANK_DIR = re.compile(r"rank-(\d{5,})")
PEER_DIR = re.compile(r"peer-of-rank-(\d{5,})")
DISK_ID = "disk-id"


def run_folder(section: LocalTierSection, run_id: str) -> str:
    """This node's folder of the run `run_id`: `DIR/<run id>`."""
    return f"{section.dir.rstrip('/')}/{run_id}"


def local_store(section: LocalTierSection, run_id: str, rank: int) -> CheckpointStore:
    """The local checkpoints of rank `rank` of the run `run_id` (`DIR/<run id>/rank-NNNNN`)."""
    return CheckpointStore(f"{run_folder(section, run_id)}/rank-{rank:05d}", keep_last=section.keep)


def peer_store(section: LocalTierSection, run_id: str, owner: int) -> CheckpointStore:
    """The copies of rank `owner`'s local checkpoints that this node's folder holds."""
    return CheckpointStore(f"{run_folder(section, run_id)}/peer-of-rank-{owner:05d}", keep_last=section.keep)


@dataclass(frozen=True)
class Folder:
    """One folder of this node's: `name`, the rank whose copies it holds (`owner`), `tier` (LOCAL:
    a rank's own folder, PEER: the copies another node sent), its `store`."""

    name: str
    owner: int
    tier: str
    store: CheckpointStore


def folder(section: LocalTierSection, run_id: str, name: str) -> Folder | None:
    """The folder `name` of the run `run_id` on this node; None for a name that is not a folder of
    copies."""
    if own := RANK_DIR.fullmatch(name):
        return Folder(name, int(own[1]), LOCAL, local_store(section, run_id, int(own[1])))
    if peer := PEER_DIR.fullmatch(name):
        return Folder(name, int(peer[1]), PEER, peer_store(section, run_id, int(peer[1])))
    return None


def folders(section: LocalTierSection, run_id: str) -> list[Folder]:
    """Every folder of copies of the run `run_id` on this node, whoever wrote it, by name."""
    loc = open_location(run_folder(section, run_id))
    with suppress(FileNotFoundError):
        names = sorted(folder_name(path) for path in loc.fs.ls(loc.root, detail=False))
        return [f for name in names if (f := folder(section, run_id, name)) is not None]
    return []


def disk_id(section: LocalTierSection, run_id: str) -> str:
    """A name for the storage behind this node's folder of the run, the same on every rank that
    sees the same files there: a random token the first rank to look writes into `DISK_ID`
    (atomically: the last of several racing writers wins), read by every rank once all have
    looked. Collective: every rank calls it at the same point."""
    loc = open_location(run_folder(section, run_id))
    path = f"{loc.root}/{DISK_ID}"
    if not loc.fs.exists(path):
        loc.fs.makedirs(loc.root, exist_ok=True)
        if loc.is_local:
            work = f"{path}.tmp-{token_hex(4)}"
            write_small(loc, work, token_hex(16).encode())
            rename(loc, work, path)
            fsync_dir(loc, loc.root)
        else:
            write_small(loc, path, token_hex(16).encode())
    distributed.barrier()
    with open_read(loc, path) as f:
        return bytes(f.read()).decode()
