"""store.py + into_live.py: bitwise round trips, atomic commit, discovery of the newest good checkpoint,
and loading that checks what it loads and streams into live storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.checkpoint import CheckpointError, CheckpointStore, Verify, capture, load
from harness.checkpoint.errors import CheckpointCorrupt
from harness.errors import UserError
from helpers import flip_byte

from .conftest import Bag, Tiny, folder, rewrite_manifest, state_of, torch_state


@pytest.mark.parametrize("url", ["local", "memory://rt"])
def test_full_training_state_round_trips_bitwise(run_dir, url):
    store = CheckpointStore(run_dir if url == "local" else url)
    saved = torch_state(steps=3)
    ref = store.save(3, saved, meta={"config": {"lr": 0.01}})
    fresh = torch_state(seed=1, steps=0)
    assert state_of(fresh) != state_of(saved)
    meta = load(store, store.latest_good(), fresh)
    assert meta == {"config": {"lr": 0.01}}
    assert state_of(fresh) == state_of(saved)
    assert store.read_state(ref)["step"] == 3
    if url != "local":
        store.loc.fs.rm(store.loc.root, recursive=True)


def test_resumed_training_continues_bitwise(run_dir):
    store = CheckpointStore(run_dir)
    a = torch_state(steps=2)
    store.save(2, a)
    b = torch_state(seed=5, steps=0)
    load(store, store.latest_good(), b)
    for parts in (a, b):
        from .conftest import train

        class Both:
            def zero_grad(self, p=parts):
                p["adamw"].zero_grad()
                p["sgd"].zero_grad()

            def step(self, p=parts):
                p["adamw"].step()
                p["sgd"].step()

        train(parts["model"], Both(), parts["sched"], steps=2, seed=9)
    assert state_of(a) == state_of(b)


@pytest.mark.parametrize("arm", ["adamw", "sgdm", "muon", "lion", "olion", "adafactor"])
def test_every_optimizer_arm_round_trips_bitwise(run_dir, arm):
    from optim.build import build_bundle
    from optim.config import parse_optim_config

    def build(seed: int, steps: int):
        torch.manual_seed(seed)
        model = Tiny()
        opt, sched = build_bundle(parse_optim_config({"type": arm}), model, total_steps=10)
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 6, generator=g)).square().mean().backward()
            opt.step()
            sched.step()
        return {"model": model, "optim": opt, "sched": sched}

    store = CheckpointStore(run_dir)
    saved = build(0, 3)
    store.save(3, saved)
    fresh = build(1, 0)
    load(store, store.latest_good(), fresh)
    assert state_of(fresh) == state_of(saved)


def test_load_streams_into_the_live_tensors(run_dir):
    store = CheckpointStore(run_dir)
    store.save(1, torch_state(steps=1))
    live = torch_state(seed=1, steps=1)
    model_ptrs = {k: v.data_ptr() for k, v in live["model"].state_dict().items()}
    opt_ptrs = [s["exp_avg"].data_ptr() for s in live["adamw"].state.values()]
    load(store, store.latest_good(), live)
    assert {k: v.data_ptr() for k, v in live["model"].state_dict().items()} == model_ptrs
    assert [s["exp_avg"].data_ptr() for s in live["adamw"].state.values()] == opt_ptrs


def test_commit_is_atomic_and_leaves_only_committed_folders(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(7, torch_state(steps=1))
    assert sorted(os.listdir(Path(run_dir) / "checkpoints")) == ["step-00000007"]
    manifest = json.loads((folder(ref) / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["writer"] == store.writer_id and manifest["format_version"] == 2
    assert {f["name"] for f in manifest["files"]} == set(os.listdir(folder(ref))) - {"manifest.json"}


def test_a_failed_write_leaves_no_checkpoint_and_no_temporary_folder(run_dir):
    store = CheckpointStore(run_dir)
    store.save(1, torch_state(steps=1))
    with pytest.raises(CheckpointError):
        store.save(2, {"model": {"w": torch.zeros(2)}, "bad": {"x": torch.zeros(2, dtype=torch.complex64)}})
    assert sorted(os.listdir(Path(run_dir) / "checkpoints")) == ["step-00000001"]


def test_saving_a_step_again_replaces_it(run_dir):
    store = CheckpointStore(run_dir)
    store.save(4, {"p": {"x": 1}})
    ref = store.save(4, {"p": {"x": 2}})
    assert store.read_state(ref)["parts"]["p"] == {"x": 2}
    assert [r.step for r in store.list()] == [4]


def _damage(kind: str, ref) -> str:
    d = folder(ref)
    model = d / "model.safetensors"
    if kind == "truncated":
        model.write_bytes(model.read_bytes()[:-5])
    elif kind == "flipped byte":
        flip_byte(model, at=-3, mask=0x01)
    elif kind == "missing file":
        model.unlink()
    elif kind == "missing manifest":
        (d / "manifest.json").unlink()
    elif kind == "malformed manifest":
        (d / "manifest.json").write_text('{"format_version": 1, "step": ')
    elif kind == "path outside":
        doc = json.loads((d / "manifest.json").read_text())
        doc["files"][0]["name"] = "../x"
        (d / "manifest.json").write_text(json.dumps(doc))
    elif kind == "absurd header":
        model.write_bytes((2**62).to_bytes(8, "little") + model.read_bytes()[8:])
        rewrite_manifest(ref)
    return _damage_message(kind)


def _damage_message(kind: str) -> str:
    return {"truncated": "bytes, the manifest says", "flipped byte": "blake3", "missing file": "missing",
            "missing manifest": "no manifest.json", "malformed manifest": "malformed manifest",
            "path outside": "not a plain file name", "absurd header": "header length"}[kind]


DAMAGE = ["truncated", "flipped byte", "missing file", "missing manifest", "malformed manifest", "path outside",
          "absurd header"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_newest_checkpoint_is_reported_and_skipped(run_dir, kind, capsys):
    store = CheckpointStore(run_dir)
    store.save(1, torch_state(steps=1))
    newest = store.save(2, torch_state(steps=2))
    message = _damage(kind, newest)
    if kind != "missing manifest":
        assert any(message in p for p in store.verify(newest)), store.verify(newest)
    assert store.latest_good().step == 1
    if kind != "missing manifest":
        assert message in capsys.readouterr().out


# The damage a listing and the manifest show; the rest is inside files at their recorded sizes.
SEEN_WITHOUT_READING_DATA = {"truncated", "missing file", "missing manifest", "malformed manifest", "path outside"}


@pytest.mark.parametrize("kind", DAMAGE)
def test_latest_committed_skips_what_shows_without_reading_data(run_dir, kind):
    """The supervisor's progress probe: a checkpoint whose files are not all there at their
    recorded sizes is passed over; damage inside a file of the right size is left to the
    resume's verification (the probe reads no data, so it cannot see it)."""
    store = CheckpointStore(run_dir)
    store.save(1, torch_state(steps=1))
    newest = store.save(2, torch_state(steps=2))
    assert store.latest_committed() == newest
    _damage(kind, newest)
    assert store.latest_committed().step == (1 if kind in SEEN_WITHOUT_READING_DATA else 2)


@pytest.mark.parametrize("verify", [Verify.BEFORE, Verify.WHILE])
@pytest.mark.parametrize("kind", DAMAGE)
def test_loading_a_damaged_checkpoint_is_a_clean_error(run_dir, kind, verify):
    store = CheckpointStore(run_dir)
    ref = store.save(2, torch_state(steps=2))
    _damage(kind, ref)
    live = torch_state(seed=1, steps=0)
    before = state_of(live)
    with pytest.raises(UserError) as e:
        load(store, ref, live, verify=verify)
    assert _damage_message(kind) in str(e.value)
    if verify is Verify.BEFORE or kind != "flipped byte":
        assert state_of(live) == before  # refused before anything was streamed


def test_a_flipped_byte_is_caught_while_loading_before_any_part_takes_its_state(run_dir):
    """One pass: the bytes stream into the live tensors while they are hashed, and the mismatch
    is raised before `load_state_dict`, so the optimizer and scheduler keep their state."""
    store = CheckpointStore(run_dir)
    ref = store.save(2, torch_state(steps=2))
    _damage("flipped byte", ref)
    live = torch_state(seed=1, steps=0)
    sched = live["sched"].state_dict()
    with pytest.raises(CheckpointCorrupt, match="model.safetensors.*blake3"):
        load(store, ref, live, verify=Verify.WHILE)
    assert live["sched"].state_dict() == sched


@pytest.mark.parametrize("url", ["local", "memory://verified"])
def test_a_load_verified_while_streaming_is_bitwise(run_dir, url):
    store = CheckpointStore(run_dir if url == "local" else url)
    saved = torch_state(steps=3)
    store.save(3, saved)
    fresh = torch_state(seed=1, steps=0)
    load(store, store.candidates()[0], fresh, verify=Verify.WHILE)
    assert state_of(fresh) == state_of(saved)
    if url != "local":
        store.loc.fs.rm(store.loc.root, recursive=True)


def test_a_skipped_part_is_still_hashed_while_loading(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(2, torch_state(steps=2))
    flip_byte(folder(ref) / "model.safetensors", at=-3, mask=0x01)
    with pytest.raises(CheckpointCorrupt, match="model.safetensors"):
        load(store, ref, torch_state(seed=1, steps=0), skip=("model",), verify=Verify.WHILE)


def _pickle_bomb(sentinel: Path) -> bytes:
    """A protocol-0 pickle whose loading runs os.system("touch sentinel") (built by hand, no pickle)."""
    return f"cos\nsystem\n(S'touch {sentinel}'\ntR.".encode()


def test_a_pickle_renamed_to_safetensors_is_never_executed(run_dir, tmp_path):
    proof = tmp_path / "proof"
    bomb = tmp_path / "bomb.pkl"
    bomb.write_bytes(_pickle_bomb(proof))
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))", str(bomb)],
                   check=True)
    assert proof.exists(), "the planted payload must really run code when unpickled"

    sentinel = tmp_path / "sentinel"
    store = CheckpointStore(run_dir)
    ref = store.save(1, torch_state(steps=1))
    payload = _pickle_bomb(sentinel)
    (folder(ref) / "model.safetensors").write_bytes(payload + b"\x00" * 64)
    rewrite_manifest(ref)
    assert any("header length" in p for p in store.verify(ref))
    assert store.latest_good() is None
    with pytest.raises(CheckpointError, match="header length"):
        load(store, ref, torch_state(seed=1, steps=0))
    torch_file = tmp_path / "t.pt"
    torch.save({"w": torch.zeros(3)}, torch_file)
    (folder(ref) / "model.safetensors").write_bytes(torch_file.read_bytes())
    rewrite_manifest(ref)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load(store, ref, torch_state(seed=1, steps=0))
    assert not sentinel.exists()


def test_state_json_cannot_point_outside_the_manifest(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"p": {"w": torch.zeros(2)}})
    state = folder(ref) / "state.json"
    state.write_text(state.read_text().replace('"p.safetensors"', '"../../x.safetensors"'))
    rewrite_manifest(ref)
    with pytest.raises(CheckpointError, match="does not list"):
        load(store, ref, {"p": Bag()})


def test_a_changed_byte_in_state_json_is_named_as_a_digest_not_a_size(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"p": {"w": torch.zeros(2)}})
    state = folder(ref) / "state.json"
    flip_byte(state, at=-2, mask=0x01)  # the same size, one bit changed
    with pytest.raises(CheckpointCorrupt, match=r"state.json: does not match the manifest \(its blake3 digest differs"):
        store.open(ref)


def test_shape_dtype_and_name_mismatches_are_listed_together(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"model": {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1),
                                   "gone": torch.zeros(1)}})
    live = Bag({"a": torch.ones(3, 2), "b": torch.ones(4, dtype=torch.float64), "c": torch.ones(1),
                "new": torch.ones(1)})
    with pytest.raises(CheckpointError) as err:
        load(store, ref, {"model": live})
    text = str(err.value)
    assert "model/a: checkpoint float32[2, 3], live float32[3, 2]" in text
    assert "model/b: checkpoint float32[4], live float64[4]" in text
    assert "model/new: missing from the checkpoint" in text and "model/gone: in the checkpoint but not" in text
    assert "model/c" not in text
    assert torch.equal(live.tree["c"], torch.ones(1)), "nothing is loaded when anything does not fit"


def test_skipped_tensors_keep_their_live_values(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"model": {"a": torch.zeros(2, 3), "c": torch.zeros(1), "gone": torch.zeros(1)}})
    new, a = torch.full((1,), 5.0), torch.ones(3, 2)
    live = Bag({"a": a, "c": torch.ones(1), "new": new})
    load(store, ref, {"model": live}, skip=["model/a", "model/new", "model/gone"])
    assert live.tree["a"] is a and live.tree["new"] is new and "gone" not in live.tree
    assert torch.equal(live.tree["c"], torch.zeros(1))


def test_missing_and_unexpected_parts_are_named_unless_skipped(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"model": {"x": 1}, "old": {"y": 2}})
    with pytest.raises(CheckpointError, match=r"no part\(s\) \['new'\].*part\(s\) \['old'\]"):
        load(store, ref, {"model": Bag(), "new": Bag()})
    model = Bag()
    load(store, ref, {"model": model, "new": Bag({"keep": 1})}, skip=["new", "old"])
    assert model.tree == {"x": 1}


def test_a_part_that_refuses_its_state_becomes_a_user_error(run_dir):
    store = CheckpointStore(run_dir)
    ref = store.save(1, {"counter": {"count": "three"}})

    class Counter:
        def state_dict(self):
            return {"count": 0}

        def load_state_dict(self, state):
            int(state["count"])

    with pytest.raises(CheckpointError, match="part 'counter' refused the checkpoint's state: invalid literal"):
        load(store, ref, {"counter": Counter()})


def test_snapshot_with_replaced_tensors_commits_the_same_bytes(run_dir, tmp_path):
    parts = torch_state(steps=2)
    snap = capture(parts)
    copies = {f: {n: t.detach().clone() for n, t in named.items()} for f, named in snap.tensors.items()}
    a = CheckpointStore(run_dir).commit(2, snap.with_tensors(copies))
    b = CheckpointStore(str(tmp_path / "b")).commit(2, snap)
    files = [json.loads((folder(r) / "manifest.json").read_text())["files"] for r in (a, b)]
    assert files[0] == files[1]
    with pytest.raises(ValueError):
        snap.with_tensors({f: {} for f in snap.tensors})


def test_run_dir_that_does_not_exist_or_is_empty_has_no_checkpoint(tmp_path):
    assert CheckpointStore(str(tmp_path / "nope")).latest_good() is None
    (tmp_path / "empty").mkdir()
    assert CheckpointStore(str(tmp_path / "empty")).latest_good() is None


def test_unknown_protocol_is_a_user_error_naming_it():
    with pytest.raises(UserError, match="'nosuch'"):
        CheckpointStore("nosuch://bucket/run")
