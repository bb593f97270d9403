"""RNGState: a capture survives the checkpoint's split into safetensors + JSON and replays
every stream exactly; a rank's GPU stream follows the rank to whatever device it trains on after
a restart (checked here with a faked set of GPUs: torch.cuda's generator functions replaced)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoint import CheckpointStore, load
from harness.errors import UserError
from harness.repro.rng import RNGState, seed_everything
from helpers import FakeGpus


def to_checkpoint(tree, tensors: dict[str, torch.Tensor], path: str = "rng"):
    """Mimic the checkpoint format: tensors out by path, the rest as JSON with placeholders."""
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree
        return {"tensor": path}
    if isinstance(tree, dict):
        return {k: to_checkpoint(v, tensors, f"{path}/{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_checkpoint(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]
    assert tree is None or isinstance(tree, (int, float, str, bool)), type(tree)
    return tree


def from_checkpoint(tree, tensors: dict[str, torch.Tensor]):
    if isinstance(tree, dict):
        if tree.keys() == {"tensor"}:
            return tensors[tree["tensor"]]
        return {k: from_checkpoint(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_checkpoint(v, tensors) for v in tree]
    return tree


def draw_everything() -> tuple:
    """One draw from each stream, including the cached-gaussian paths of python and numpy."""
    dropout = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    return (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(4), dropout)


def assert_same_draws(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3]
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


def test_round_trip_through_safetensors_and_json_replays_every_stream(tmp_path):
    seed_everything(42)
    # Odd numbers of gaussian draws leave a cached value in python's and numpy's state.
    random.gauss(0, 1)
    np.random.standard_normal(1)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(to_checkpoint(RNGState("cpu").state_dict(), tensors))
    save_file(tensors, str(tmp_path / "rank-00000.safetensors"))
    expected = draw_everything()

    seed_everything(7)
    restored = from_checkpoint(json.loads(skeleton), load_file(str(tmp_path / "rank-00000.safetensors")))
    RNGState("cpu").load_state_dict(restored)
    assert_same_draws(draw_everything(), expected)


def test_state_dict_shape():
    state = RNGState("cpu").state_dict()
    assert state["torch"].dtype == torch.uint8
    assert isinstance(state["python"]["state"], list) and len(state["python"]["state"]) == 625
    assert len(state["numpy"]["key"]) == 624
    assert "cuda" not in state  # a process training on the CPU has no GPU stream, whatever the host has


def test_seed_everything_fixes_all_streams():
    seed_everything(3)
    first = draw_everything()
    seed_everything(3)
    assert_same_draws(draw_everything(), first)
    seed_everything(-5)  # negative seeds are valid run seeds; numpy's range must not reject them


def test_a_rank_restarted_on_another_gpu_restores_its_own_stream_there(monkeypatch):
    """Rank 1 trained on cuda:1 of 2; after the restart it trains on cuda:0 (another node, another
    local rank, a swapped CUDA_VISIBLE_DEVICES): its dropout stream goes onto cuda:0, and the
    other index keeps its own. (Every visible GPU's stream restored by index put it on cuda:1.)"""
    before = FakeGpus(monkeypatch, 2)
    before.set(torch.full((16,), 41, dtype=torch.uint8), 1)  # rank 1's stream after its steps
    saved = RNGState(torch.device("cuda", 1)).state_dict()
    assert torch.equal(saved["cuda"], torch.full((16,), 41, dtype=torch.uint8))

    after = FakeGpus(monkeypatch, 2)
    RNGState(torch.device("cuda", 0)).load_state_dict(saved)
    assert torch.equal(after.states[0], torch.full((16,), 41, dtype=torch.uint8))
    assert torch.equal(after.states[1], torch.full((16,), 1, dtype=torch.uint8))


def test_another_number_of_visible_gpus_resumes(monkeypatch):
    """Written on a host showing 2 GPUs, resumed on one showing 1 (a 2 -> 1 elastic resume, a
    smaller allocation): the stream goes onto the rank's device, no refusal."""
    FakeGpus(monkeypatch, 2).set(torch.full((16,), 9, dtype=torch.uint8), 1)
    saved = RNGState("cuda:1").state_dict()
    after = FakeGpus(monkeypatch, 1)
    RNGState("cuda:0").load_state_dict(saved)
    assert torch.equal(after.states[0], torch.full((16,), 9, dtype=torch.uint8))


def test_a_cpu_hosts_checkpoint_resumes_on_a_gpu_host_on_either_device(monkeypatch, tmp_path):
    """A checkpoint written where no GPU is visible loads on a GPU host, through the checkpoint's
    own restore, into a process training on the CPU (train.device = "cpu") and into one training
    on a GPU (which keeps its seeded stream); a GPU stream loads into a CPU-trained process too."""
    store = CheckpointStore(str(tmp_path))
    seed_everything(5)
    store.save(1, {"rng": RNGState("cpu")})
    expected = draw_everything()
    gpus = FakeGpus(monkeypatch, 2)
    for device in ("cpu", "cuda:1"):
        seed_everything(6)
        load(store, store.ref(1), {"rng": RNGState(device)})
        assert_same_draws(draw_everything(), expected)
    assert torch.equal(gpus.states[1], torch.full((16,), 1, dtype=torch.uint8))

    gpus.set(torch.full((16,), 7, dtype=torch.uint8), 1)
    store.save(2, {"rng": RNGState("cuda:1")})
    load(store, store.ref(2), {"rng": RNGState("cpu")})
    load(store, store.ref(2), {"rng": RNGState("cuda:0")})
    assert torch.equal(gpus.states[0], torch.full((16,), 7, dtype=torch.uint8))


def test_an_older_harness_list_of_every_gpu_restores_the_entry_of_this_device(monkeypatch):
    """Checkpoints of an older harness hold every visible GPU's stream, by index: the entry of the
    rank's device index is the one that harness restored onto it; an index past the list is
    refused in one line."""
    gpus = FakeGpus(monkeypatch, 3)
    state = RNGState("cpu").state_dict()
    state["cuda"] = [torch.full((16,), 20 + i, dtype=torch.uint8) for i in range(2)]
    RNGState("cuda:1").load_state_dict(state)
    assert torch.equal(gpus.states[1], torch.full((16,), 21, dtype=torch.uint8))
    with pytest.raises(UserError, match="RNG states of 2 CUDA devices .* trains on cuda:2"):
        RNGState("cuda:2").load_state_dict(state)


def test_incomplete_state_is_refused():
    state = RNGState("cpu").state_dict()
    del state["torch"]
    with pytest.raises(UserError, match="lacks \\['torch'\\]"):
        RNGState("cpu").load_state_dict(state)
