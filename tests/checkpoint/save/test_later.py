"""checkpoint/later.py through a background save: the fingerprints' state hash taken from the staged
copies by the writer, equal to the hash of the live state at the save, never read by the step loop.

(The whole trainer's state.json, with this hash, equal to a synchronous save's for every optimizer
arm: test_async_save.py.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from harness.checkpoint import CheckpointError, CheckpointStore, capture
from harness.checkpoint.format import dump_state
from harness.checkpoint.later import Later, deferring, later_values
from harness.checkpoint.save.async_saver import AsyncSaver, ring_feeds
from harness.checkpoint.save.commit import Committer
from harness.checkpoint.save.staging_ring import MIN_CAPACITY, PIECE_BYTES
from harness.repro import fingerprint
from harness.repro.fingerprint import FingerprintLog, part_hashes, state_digests


def state(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, FingerprintLog]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    return model, opt, FingerprintLog(lambda: {"model": model, "optim": opt}, every=0)


def saved_state_hash(store: CheckpointStore, step: int) -> dict[str, str]:
    return json.loads(Path(store.ref(step).url, "state.json").read_text())["parts"]["fingerprints"]["state_hash"]


@pytest.mark.parametrize("capacity", [None, MIN_CAPACITY], ids=["ring-holds-all", "ring-streams"])
def test_the_saved_state_hash_is_the_live_state_at_the_save_and_the_step_loop_never_hashes_it(
        tmp_path, monkeypatch, capacity):
    """With a ring under the state's size, each large tensor reaches the writer in several pieces
    (PIECE_BYTES), all fed to its digest. The next step changes every tensor in place once `save`
    returns (with a ring that holds the state, before the writer starts); the saved hash is still
    the one of the state at the save."""
    width = 4096 if capacity else 256  # a 64 MiB weight and its momentum: over the 64 MiB ring, 4 pieces each
    model, opt, fp = state(width)
    parts = {"model": model, "optim": opt, "fingerprints": fp}
    big = model[0].weight.nbytes
    assert capacity is None or (big > PIECE_BYTES and 2 * big > capacity)  # streamed, in several pieces
    at_save = part_hashes(state_digests({"model": model, "optim": opt}, saved_only=True))
    store = CheckpointStore(str(tmp_path))
    saver = AsyncSaver(Committer(store), staging_bytes=capacity)
    read_on_the_step_loop: list[tuple[int, ...]] = []
    real_digest = fingerprint.tensor_digest
    monkeypatch.setattr(fingerprint, "tensor_digest",
                        lambda t: (read_on_the_step_loop.append(tuple(t.shape)), real_digest(t))[1])
    gate = threading.Event()
    if capacity is None:  # a streaming writer drains the ring while `save` copies: it cannot wait
        persist = saver._persist
        saver._persist = lambda *a: (gate.wait(30), persist(*a))[1]
    saver.save(1, parts)
    opt.step()  # the next step
    gate.set()
    saver.finish()
    assert read_on_the_step_loop == []  # every tensor of model and optim is staged: none hashed live
    assert part_hashes(state_digests({"model": model, "optim": opt}, saved_only=True)) != at_save
    assert saved_state_hash(store, 1) == at_save


def test_a_tensor_the_ring_does_not_stage_is_hashed_at_the_save():
    """A rank's snapshot lists only what it writes; a `Later` reading any other tensor hashes it
    at once, at the step boundary (here: a model nobody saves, only hashed)."""
    model, opt, _ = state(8)
    other = torch.nn.Linear(3, 3)
    fp = FingerprintLog(lambda: {"model": model, "optim": opt, "other": other}, every=0)
    with deferring():
        snapshot = capture({"model": model, "optim": opt, "fingerprints": fp})
    streamed = {f: named for f, named in snapshot.tensors.items()}
    feeds = ring_feeds(snapshot, streamed)
    assert sum(len(v) for v in feeds.values()) == sum(len(named) for named in streamed.values())
    at_save = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)  # after the save: must not reach the hash
    for (file, name), readers in feeds.items():  # what the writer does with the staged bytes
        for reader in readers:
            reader.update(memoryview(snapshot.tensors[file][name].detach().reshape(-1).view(torch.uint8).numpy()))
            reader.finish()
    later = next(later_values(snapshot.parts))
    with torch.no_grad():
        other.weight.copy_(at_save)
    assert later.value() == part_hashes(state_digests({"model": model, "optim": opt, "other": other},
                                                      saved_only=True))


def test_a_later_value_never_bound_or_fed_stops_the_write_instead_of_writing_a_wrong_hash():
    model, opt, fp = state(8)
    with deferring():
        snapshot = capture({"model": model, "optim": opt, "fingerprints": fp})
    assert isinstance(snapshot.parts["fingerprints"]["state_hash"], Later)
    with pytest.raises(RuntimeError, match="never bound"):
        dump_state(1, snapshot, None)
    ring_feeds(snapshot, {f: named for f, named in snapshot.tensors.items()})
    with pytest.raises(RuntimeError, match="before its bytes were fed"):
        dump_state(1, snapshot, None)


def test_outside_a_background_save_the_state_hash_is_computed_at_once():
    model, opt, fp = state(8)
    snapshot = capture({"model": model, "optim": opt, "fingerprints": fp})
    assert snapshot.parts["fingerprints"]["state_hash"] == part_hashes(
        state_digests({"model": model, "optim": opt}, saved_only=True))
    with pytest.raises(CheckpointError, match="no pickle"):
        capture({"bad": {"x": object()}})  # a Later is allowed as a leaf; other objects still are not
