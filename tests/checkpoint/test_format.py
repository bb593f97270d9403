"""format.py + tensorfile.py: what the files hold, exactly, and what a reader refuses."""

from __future__ import annotations

import io
import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint import CheckpointError, CheckpointStore, capture
from harness.checkpoint.format import decode, tensor_refs
from harness.checkpoint.tensorfile import read_header, read_tensor, serialize

from .conftest import flat, torch_state


def _file_bytes(tensors) -> bytes:
    return b"".join(bytes(c) for c in serialize(tensors, "test"))


def test_capture_references_live_storage_without_copying():
    parts = torch_state(steps=1)
    snap = capture(parts)
    weight = parts["model"].blocks[0].weight
    assert snap.tensors["model.safetensors"]["blocks.0.weight"].data_ptr() == weight.data_ptr()
    assert set(snap.tensors) == {"model.safetensors", "adamw.safetensors", "sgd.safetensors", "extra.safetensors"}
    assert snap.tensors["adamw.safetensors"]["state/0/exp_avg"].shape == weight.shape


def test_rank_parts_share_the_rank_file_under_their_part_name():
    snap = capture({"rng": {"torch": torch.zeros(3, dtype=torch.uint8)}, "data": {"pos": torch.tensor(4)}}, rank=3,
                   per_rank={"rng", "data"})
    assert set(snap.tensors) == {"rank-00003.safetensors"}
    assert set(snap.tensors["rank-00003.safetensors"]) == {"rng/torch", "data/pos"}


def test_json_tree_round_trips_int_keys_dollar_keys_and_exact_floats():
    tree = {"a": {0: 1.1, 2: [None, True]}, "$x": 0.1 + 0.2, "n": float("nan"), "i": -float("inf"), "s": 5e-324}
    snap = capture({"p": tree})
    stored = json.loads(json.dumps(snap.parts["p"]))
    back = decode(stored, lambda path, ref: None)
    assert back["a"] == {0: 1.1, 2: [None, True]} and back["$x"] == 0.1 + 0.2 and back["s"] == 5e-324
    assert math.isnan(back["n"]) and back["i"] == -float("inf")


@pytest.mark.parametrize("value", [object(), {1.5: 2}, {(1, 2): 3}, {"x": {True: 1}}])
def test_values_a_checkpoint_cannot_hold_are_refused_by_path(value):
    with pytest.raises(CheckpointError, match="p"):
        capture({"p": {"v": value}})


def test_bad_part_name_is_refused():
    with pytest.raises(CheckpointError, match="part name"):
        capture({"../x": {}})


def test_colliding_tensor_names_are_disambiguated():
    snap = capture({"p": {"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}})
    assert len(snap.tensors["p.safetensors"]) == 2
    assert len(set(tensor_refs(snap.parts["p"]).values())) == 2


def test_same_state_gives_the_same_bytes(tmp_path):
    parts = torch_state()
    refs = [CheckpointStore(str(tmp_path / n)).save(5, parts, meta={"m": 1}) for n in "ab"]
    for name in ("model.safetensors", "adamw.safetensors", "state.json"):
        assert ((tmp_path / "a/checkpoints/step-00000005" / name).read_bytes()
                == (tmp_path / "b/checkpoints/step-00000005" / name).read_bytes())
    manifests = [json.loads(open(f"{r.path}/manifest.json").read())["files"] for r in refs]
    assert manifests[0] == manifests[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_files_are_readable_by_the_safetensors_library(tmp_path, dtype):
    tensors = {"x": torch.arange(12).reshape(3, 4).to(dtype), "s": torch.tensor(3).to(dtype),
               "e": torch.zeros(0, 2, dtype=dtype), "t": torch.arange(6).reshape(2, 3).to(dtype).t()}
    path = tmp_path / "f.safetensors"
    path.write_bytes(_file_bytes(tensors))
    loaded = load_file(str(path))
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype and loaded[name].shape == t.shape
        assert flat(loaded[name]) == flat(t.contiguous())


def test_read_tensor_reads_into_the_live_tensor_in_place():
    data = _file_bytes({"w": torch.arange(6.0).reshape(2, 3)})
    f = io.BytesIO(data)
    entries = read_header(f, len(data), "f")
    live = torch.zeros(2, 3)
    ptr = live.data_ptr()
    out = read_tensor(f, entries["w"], "f", out=live)
    assert out is live and live.data_ptr() == ptr and torch.equal(live, torch.arange(6.0).reshape(2, 3))
    strided = torch.zeros(3, 2).t()
    read_tensor(f, entries["w"], "f", out=strided)
    assert torch.equal(strided, torch.arange(6.0).reshape(2, 3))


def test_a_large_tensor_is_written_and_read_in_pieces_the_hash_can_follow(monkeypatch):
    """A tensor of 2.5 pieces goes to the writer, and comes from the reader, 16 MiB at most at a
    time (the hash behind them then runs piece by piece, never a whole tensor after its write),
    the file the same bytes as written whole."""
    from harness.checkpoint import tensorfile

    monkeypatch.setattr(tensorfile, "PIECE_BYTES", 1 << 10)
    w = torch.arange(640.0)  # 2560 bytes
    chunks = list(serialize({"w": w}, "test"))
    assert [len(c) for c in chunks[1:]] == [1024, 1024, 512]
    data = b"".join(bytes(c) for c in chunks)
    monkeypatch.setattr(tensorfile, "PIECE_BYTES", 1 << 20)
    assert data == _file_bytes({"w": w})

    class Reads(io.BytesIO):
        sizes: list[int] = []

        def readinto(self, view):
            self.sizes.append(len(view))
            return super().readinto(view)

    monkeypatch.setattr(tensorfile, "PIECE_BYTES", 1 << 10)
    f = Reads(data)
    entries = read_header(f, len(data), "f")
    live = torch.zeros(640)
    read_tensor(f, entries["w"], "f", out=live)
    assert torch.equal(live, w) and max(Reads.sizes) == 1 << 10


def _header(doc: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("blob, message", [
    (b"", "too short"),
    (struct.pack("<Q", 2**62) + b"{}", "header length"),
    (struct.pack("<Q", 1) + b"{", "header length"),
    (b"\x80\x04\x95" + b"\x00" * 40, "header length"),
    (b"PK\x03\x04" + b"\x00" * 40, "header length"),
    (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 4), "truncated"),
    (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 12), "unexpected bytes"),
    (_header({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\x00" * 8), "cannot hold"),
    (_header({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 8), "unknown dtype"),
    (_header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\x00" * 8), "malformed"),
    (_header({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\x00" * 6), "starts at byte"),
    (_header([1, 2]), "not a JSON object"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "malformed"),
    (struct.pack("<Q", 17) + b'{"a":1,"a":2}    ', "duplicate"),
])
def test_malformed_safetensors_are_refused_cleanly(blob, message):
    with pytest.raises(CheckpointError, match=message):
        read_header(io.BytesIO(blob), len(blob), "bad.safetensors")
