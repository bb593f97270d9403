"""A rank's own checkpoint of sharded parts (the local tier under FSDP: `CheckpointStore.commit`
with `own_shards`, dcp.py `save_shards(own=True)`), in one process; the real FSDP ranks are
tests/distributed/test_local_tier_fsdp.py. And `check_fit`'s refusal of stored chunks that do
not cover a live tensor's share (another rank's own checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from harness.checkpoint import CheckpointError, CheckpointStore, capture, load
from harness.checkpoint.dcp import check_fit

from .conftest import Bag, folder


def test_a_sharded_snapshot_commits_as_this_ranks_own_checkpoint_only_when_asked(run_dir):
    store = CheckpointStore(run_dir)
    saved = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    snapshot = capture({"model": {"w": saved}, "trainer": {"step": 5}}, sharded={"model"})
    with pytest.raises(CheckpointError, match="every rank of its group"):
        store.commit(5, snapshot)
    ref = store.commit(5, snapshot, own_shards=True)
    names = {f["name"] for f in json.loads((folder(ref) / "manifest.json").read_text())["files"]}
    assert names == {"shards-00000.safetensors", "dcp-metadata.json", "state.json"}
    assert store.verify(ref) == []
    live = Bag({"w": torch.zeros(2, 3)})
    load(store, ref, {"model": live, "trainer": Bag()})
    assert torch.equal(live.tree["w"], saved)


def metadata(*chunks: tuple[list[int], list[int]]) -> Metadata:
    """DCP metadata of one float32 tensor `w` of shape [4, 3] stored as `chunks` (offsets, sizes)."""
    stored = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), stored)
    return Metadata(state_dict_metadata={"w": meta})


def test_stored_chunks_must_cover_the_live_share():
    live = {"w": torch.zeros(4, 3)}  # one process: its share is the whole tensor
    assert check_fit(metadata(([0, 0], [2, 3]), ([2, 0], [2, 3])), live, "ckpt") == []
    (problem,) = check_fit(metadata(([2, 0], [2, 3])), live, "ckpt")  # rank 1's own shards alone
    assert "do not cover this rank's share (offsets [0, 0], sizes [4, 3])" in problem
