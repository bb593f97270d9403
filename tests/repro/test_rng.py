"""RNGState: a capture survives the checkpoint's split into safetensors + JSON and replays
every stream exactly."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.errors import UserError
from harness.repro.rng import RNGState, seed_everything


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
    skeleton = json.dumps(to_checkpoint(RNGState().state_dict(), tensors))
    save_file(tensors, str(tmp_path / "rank-00000.safetensors"))
    expected = draw_everything()

    seed_everything(7)
    restored = from_checkpoint(json.loads(skeleton), load_file(str(tmp_path / "rank-00000.safetensors")))
    RNGState().load_state_dict(restored)
    assert_same_draws(draw_everything(), expected)


def test_state_dict_shape():
    state = RNGState().state_dict()
    assert state["torch"].dtype == torch.uint8
    assert isinstance(state["python"]["state"], list) and len(state["python"]["state"]) == 625
    assert len(state["numpy"]["key"]) == 624
    assert ("cuda" in state) == torch.cuda.is_available()


def test_seed_everything_fixes_all_streams():
    seed_everything(3)
    first = draw_everything()
    seed_everything(3)
    assert_same_draws(draw_everything(), first)
    seed_everything(-5)  # negative seeds are valid run seeds; numpy's range must not reject them


def test_cuda_device_count_mismatch_is_refused():
    state = RNGState().state_dict()
    count = len(state.get("cuda", []))
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * (count + 1)
    with pytest.raises(UserError, match=f"{count + 1} CUDA devices but this process sees {count}"):
        RNGState().load_state_dict(state)


def test_incomplete_state_is_refused():
    state = RNGState().state_dict()
    del state["torch"]
    with pytest.raises(UserError, match="lacks \\['torch'\\]"):
        RNGState().load_state_dict(state)
