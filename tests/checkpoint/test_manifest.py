"""manifest.py: version 2 names BLAKE3 per file; a version 1 checkpoint (sha256), as the harness
before it wrote them, still verifies, loads, and has its damage found.

`data/sha256-v1/` was written by the harness at commit 66a4a13 (manifest version 1) with
`CheckpointStore(...).save(3, torch_state(steps=3))` from conftest.py; it is not regenerated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from harness.checkpoint import CheckpointStore, Verify, load
from harness.checkpoint.errors import CheckpointCorrupt, CheckpointError
from harness.checkpoint.manifest import MANIFEST_VERSION, parse_manifest
from harness.cli import main
from helpers import flip_byte

from .conftest import folder, torch_state

OLD_RUN = Path(__file__).parent / "data" / "sha256-v1"


@pytest.fixture
def old_run(tmp_path: Path) -> str:
    run = tmp_path / "old"
    shutil.copytree(OLD_RUN, run)
    return str(run)


def manifest_doc(ref) -> dict:
    return json.loads((folder(ref) / "manifest.json").read_text())


def test_the_fixture_is_an_old_checkpoint(old_run):
    doc = manifest_doc(CheckpointStore(old_run).ref(3))
    assert doc["format_version"] == 1 and all(set(f) == {"name", "size", "sha256"} for f in doc["files"])


def test_new_checkpoints_name_blake3_for_every_file(run_dir):
    ref = CheckpointStore(run_dir).save(1, torch_state(steps=1))
    doc = manifest_doc(ref)
    assert doc["format_version"] == MANIFEST_VERSION == 2
    assert doc["files"] and all(set(f) == {"name", "size", "blake3"} for f in doc["files"])


@pytest.mark.parametrize("verify", [Verify.BEFORE, Verify.WHILE])
def test_an_old_sha256_checkpoint_verifies_and_loads_bitwise(old_run, verify):
    store = CheckpointStore(old_run)
    assert store.verify(store.ref(3)) == [] and store.latest_good().step == 3
    live = torch_state(seed=1, steps=0)
    load(store, store.ref(3), live, verify=verify)
    # Against the files as the safetensors library reads them (a recomputed state would depend
    # on this machine's math library settings, not on the loader).
    files = folder(store.ref(3))
    model = safetensors.torch.load_file(files / "model.safetensors")
    assert model.keys() == live["model"].state_dict().keys()
    assert all(torch.equal(v, model[k]) for k, v in live["model"].state_dict().items())
    adamw = safetensors.torch.load_file(files / "adamw.safetensors")
    loaded = {f"state/{i}/{k}": v for i, st in live["adamw"].state_dict()["state"].items() for k, v in st.items()}
    assert loaded.keys() == adamw.keys() and all(torch.equal(v, adamw[k]) for k, v in loaded.items())
    assert live["extra"].state_dict()["$odd"] == 1 and live["sched"].state_dict()["last_epoch"] == 3


def test_damage_to_an_old_checkpoint_is_found_by_its_sha256(old_run):
    store = CheckpointStore(old_run)
    ref = store.ref(3)
    model = folder(ref) / "model.safetensors"
    flip_byte(model, at=-3, mask=0x01)
    assert any("model.safetensors: sha256" in p for p in store.verify(ref))
    assert store.latest_good() is None
    with pytest.raises(CheckpointCorrupt, match="model.safetensors.*sha256"):
        load(store, ref, torch_state(seed=1, steps=0), verify=Verify.WHILE)


def test_ckpt_show_names_each_files_algorithm(old_run, run_dir, capsys):
    CheckpointStore(run_dir).save(1, torch_state(steps=1))
    assert main(["ckpt", "show", f"{old_run}/checkpoints/step-00000003"]) == 0
    assert "model.safetensors" in (out := capsys.readouterr().out) and " sha256 " in out and "blake3" not in out
    assert main(["ckpt", "show", f"{run_dir}/checkpoints/step-00000001"]) == 0
    assert " blake3 " in (out := capsys.readouterr().out) and "sha256" not in out


def _entry(**fields) -> bytes:
    doc = {"format_version": 2, "step": 1, "created_unix": 0.0, "writer": "w",
           "files": [{"name": "state.json", "size": 1, **fields}]}
    return json.dumps(doc).encode()


@pytest.mark.parametrize("fields, problem", [
    ({}, "one digest named by its algorithm"),
    ({"blake3": "0" * 64, "sha256": "0" * 64}, "one digest named by its algorithm"),
    ({"md5": "0" * 32}, "one digest named by its algorithm"),
    ({"blake3": "0" * 63}, "bad size or blake3 digest"),
])
def test_an_entry_must_name_exactly_one_known_algorithm(fields, problem):
    with pytest.raises(CheckpointError, match=problem):
        parse_manifest(_entry(**fields), "m")


def test_version_1_may_only_name_sha256():
    doc = json.loads(_entry(blake3="0" * 64))
    doc["format_version"] = 1
    with pytest.raises(CheckpointError, match="one digest named by its algorithm \\(sha256\\)"):
        parse_manifest(json.dumps(doc).encode(), "m")


@pytest.mark.parametrize("version", [3, 0, True, "2"])
def test_an_unknown_version_names_the_versions_this_harness_reads(version):
    doc = json.loads(_entry(blake3="0" * 64))
    doc["format_version"] = version
    with pytest.raises(CheckpointError, match=r"reads versions \[1, 2\]"):
        parse_manifest(json.dumps(doc).encode(), "m")
