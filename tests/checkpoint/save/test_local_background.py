"""The local tier saved in the background (checkpoint/save/local_tier.py `save_like`): through the
persistent saver's own staging memory (one per rank), each save's files the bytes of a synchronous
save of the state at its step; a local save due while the persistent save before it still writes
out of the shared ring is written in the caller's thread, neither waiting for that write (to S3,
perhaps) nor overwriting its bytes."""

from __future__ import annotations

import threading

import torch

from harness.checkpoint import CheckpointStore
from harness.checkpoint.save.async_saver import AsyncSaver
from harness.checkpoint.save.commit import Committer
from harness.checkpoint.save.local_tier import LocalTier
from harness.checkpoint.save.saver import Saver
from harness.config import LocalTierSection

RUN = "run-a"


def digests(store: CheckpointStore, step: int) -> dict[str, str]:
    """The tensor files' digests (state.json differs: the local tier stamps its meta)."""
    return {r.name: r.digest for r in store.manifest(store.ref(step)).files if r.name.endswith(".safetensors")}


class HeldWrites(CheckpointStore):
    """A store whose file writes stop after their first chunk until `release` is set."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.release, self.writing = threading.Event(), threading.Event()

    def write_file(self, work, ref, name, chunks):
        def held(chunks):
            for chunk in chunks:
                yield chunk
                self.writing.set()
                assert self.release.wait(30)
        return super().write_file(work, ref, name, held(chunks))


def state() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(3)},
            "optim": {"m": torch.randn(1 << 20, generator=g)}}


def test_local_saves_take_the_run_dirs_way_and_its_staging_memory(tmp_path):
    section = LocalTierSection(dir=str(tmp_path / "local"), every_steps=2)
    tier = LocalTier(section, RUN, resumed_step=0)
    assert not tier.background
    persistent = AsyncSaver(Committer(CheckpointStore(str(tmp_path / "run"))))
    tier.save_like(persistent)
    assert tier.background and tier.saver.staging is persistent.staging
    tier.save_like(Saver(Committer(CheckpointStore(str(tmp_path / "run")))))
    assert not tier.background


def test_a_local_save_due_while_the_persistent_save_holds_the_ring_is_written_in_the_callers_thread(tmp_path):
    """The persistent save of step 1 holds the ring (its writer stopped after one chunk); the
    state changes in place and the local tier saves step 2 meanwhile: committed before the
    persistent writer goes on, from the live state. Had the local save copied into the ring
    before the persistent writer wrote it, checkpoint 1 would hold step 2's bytes."""
    live = state()
    reference = CheckpointStore(str(tmp_path / "sync"), keep_last=3)
    reference.save(1, live)
    run = HeldWrites(str(tmp_path / "run"))
    persistent = AsyncSaver(Committer(run))
    tier = LocalTier(LocalTierSection(dir=str(tmp_path / "local"), every_steps=2), RUN, resumed_step=0)
    tier.save_like(persistent)
    persistent.save(1, live)
    address = persistent.ring.address
    assert run.writing.wait(30)
    for named in live.values():
        for t in named.values():
            t.mul_(-1)
    reference.save(2, live)
    local = threading.Thread(target=tier.save, args=(2, live, {}), daemon=True)
    local.start()
    local.join(30)
    assert not local.is_alive() and persistent.busy  # it did not wait for the held persist
    assert [ref.step for ref in tier.store.list()] == [2]
    run.release.set()
    persistent.finish()
    tier.finish()
    assert digests(run, 1) == digests(reference, 1)
    assert digests(tier.store, 2) == digests(reference, 2)
    assert persistent.ring.address == address  # one staging memory for both tiers
