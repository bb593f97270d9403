"""FSDP2 at world size 2 (gloo, real processes: launch.Ranks, the gather workers too):
sharded checkpoints through DCP with our own storage layer, interrupted vs continuous bitwise,
resharding to DDP and to one process, a damaged shard skipped for the previous checkpoint. The
continuous run (`fsdp_run`, one per optimizer arm) is tests/distributed/conftest.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint import CheckpointStore
from helpers import flip_byte
from launch import Ranks, fsdp_args, kill_all, run, start, tail, wait_step
from procs import TINY, assert_same_run, events, final_checkpoint, harness

STEPS = 12
WORKER = str(Path(__file__).with_name("gather_worker.py"))


def test_checkpoint_holds_each_ranks_shards_and_json_metadata(fsdp_run):
    _, run_dir = fsdp_run
    ckpt = final_checkpoint(run_dir, STEPS)
    names = {f["name"] for f in json.loads((ckpt / "manifest.json").read_text())["files"]}
    assert {"shards-00000.safetensors", "shards-00001.safetensors", "dcp-metadata.json", "state.json"} <= names
    assert not names & {"model.safetensors", "optim.safetensors"}, "rank 0 wrote a gathered copy"
    meta = json.loads((ckpt / "dcp-metadata.json").read_text())
    weight = meta["tensors"]["model/blocks.0.attn.qkv.weight"]
    assert weight["size"] == [96, 32] and [c[1] for c in weight["chunks"]] == [[48, 32], [48, 32]]
    shard0 = load_file(str(ckpt / "shards-00000.safetensors"))  # the safetensors library reads them
    assert shard0["model/blocks.0.attn.qkv.weight@0,0"].shape == (48, 32)


def test_group_sigkill_resumes_bitwise(fsdp_run, tmp_path):
    arm, continuous = fsdp_run
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = fsdp_args(run_dir, arm)
    proc = start(args, log)
    wait_step(proc, run_dir, 6, log, committed=4)
    kill_all(proc)  # both ranks at once
    proc.wait(60)
    assert run(args, log) == 0, tail(log)
    assert [e["resumed_from"] for e in events(run_dir) if e["event"] == "start"] == [None, 4]
    # rank 0 checked the restored shards and every re-run step against the interrupted run's record
    assert not [e for e in events(run_dir) if e["event"] == "resume_mismatch"]
    assert_same_run(continuous, run_dir, STEPS)


def gather(ckpt: Path, strategy: str, out: Path, nproc: int, *overrides: str) -> dict[str, torch.Tensor]:
    args = Ranks((str(ckpt), strategy, str(out), *overrides), nproc, WORKER) if nproc > 1 else \
        [sys.executable, WORKER, str(ckpt), strategy, str(out), *overrides]
    log = out.with_suffix(".log")
    assert run(args, log) == 0, tail(log)
    assert tail(log).count("trained 2 more steps") == nproc, tail(log)
    return load_file(str(out))


def test_resharding_to_ddp_and_one_process_is_bitwise(fsdp_run, tmp_path):
    """Every parameter and optimizer tensor, gathered from the live state after the load, is
    bitwise the one FSDP at world size 2 gathers from its own shards; each then trains on."""
    _, run_dir = fsdp_run
    ckpt = final_checkpoint(run_dir, 8)
    original = gather(ckpt, "fsdp", tmp_path / "fsdp2.safetensors", 2)
    assert any(k.endswith("/exp_avg") for k in original) and any(k.startswith("model/") for k in original)
    for strategy, nproc in (("ddp", 2), ("ddp", 1)):
        loaded = gather(ckpt, strategy, tmp_path / f"{strategy}{nproc}.safetensors", nproc)
        assert sorted(loaded) == sorted(original)
        for name, t in original.items():
            assert same_bits(loaded[name], t), f"{strategy}@{nproc}: {name}"
    harness("ckpt", "consolidate", str(ckpt), "--out", str(tmp_path / "export"), check=True)
    whole = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert {f"model/{k}" for k in whole} == {k for k in original if k.startswith("model/")}
    for name, t in whole.items():
        assert same_bits(t, original[f"model/{name}"]), f"consolidated {name}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def test_damaged_shard_falls_back_to_the_previous_checkpoint(fsdp_run, tmp_path):
    """One byte of rank 1's shards flipped in the newest checkpoint: found while loading it (at
    world size 1, so the load reshards), skipped, and the run resumes from step 8 and trains on.
    The unsharded checkpoint that one process writes then loads into FSDP at world size 2 again."""
    import shutil

    _, continuous = fsdp_run
    run_dir = tmp_path / "run"
    shutil.copytree(continuous, run_dir)
    shard = final_checkpoint(run_dir, STEPS) / "shards-00001.safetensors"
    flip_byte(shard, at=-3, mask=0x01)
    done = harness("train", str(TINY), "--run-dir", str(run_dir), "--set", "train.steps=14",
                   "--allow-config-change", check=True)
    assert "shards-00001.safetensors" in done.stderr, done.stderr[-3000:]
    assert [e["resumed_from"] for e in events(run_dir) if e["event"] == "start"][-1] == 8
    assert CheckpointStore(str(run_dir)).latest_good().step == 14
    # An unsharded checkpoint (this one process wrote it) consolidates to its own model file.
    harness("ckpt", "consolidate", str(final_checkpoint(run_dir, 14)), "--out", str(tmp_path / "export"), check=True)
    whole, written = (load_file(str(p)) for p in (tmp_path / "export" / "model.safetensors",
                                                  final_checkpoint(run_dir, 14) / "model.safetensors"))
    assert sorted(whole) == sorted(written) and all(same_bits(whole[k], written[k]) for k in whole)
    sharded = gather(final_checkpoint(run_dir, 14), "fsdp", tmp_path / "fsdp2.safetensors", 2, "train.steps=16")
    optim = load_file(str(final_checkpoint(run_dir, 14) / "optim.safetensors"))
    stored = {**{f"model/{k}": v for k, v in written.items()},
              **{"optim/" + k.replace("/state/", "/", 1): v for k, v in optim.items()}}
    assert sorted(sharded) == sorted(stored)
    assert all(same_bits(sharded[k], stored[k]) for k in stored)


def _match_manifest(ckpt: Path) -> None:
    """Make the manifest list what the files now hold, so the content checks are what refuses."""
    from harness.storage.digest import hexdigest

    doc = json.loads((ckpt / "manifest.json").read_text())
    for f in doc["files"]:
        data = (ckpt / f["name"]).read_bytes()
        f["size"], f["blake3"] = len(data), hexdigest("blake3", data)
    (ckpt / "manifest.json").write_text(json.dumps(doc))


def test_hostile_shard_files_are_refused_without_running_code(fsdp_run, tmp_path):
    """A shard file replaced by a pickle (whose loading would run a command) or by a header bomb,
    a manifest entry outside the folder, DCP metadata pointing at a file the manifest does not
    list: each refused as a damaged checkpoint, loaded into one process, no code run."""
    import shutil

    from harness.checkpoint import CheckpointCorrupt, CheckpointError, Verify, load
    from harness.config import load_config
    from harness.run.trainer import Trainer

    _, continuous = fsdp_run
    sentinel = tmp_path / "sentinel"
    pickle_bomb = f"cos\nsystem\n(S'touch {sentinel}'\ntR.".encode() + b"\x00" * 64
    header_bomb = (1 << 62).to_bytes(8, "little") + b"{}"

    def metadata_outside(ckpt: Path) -> None:
        meta = ckpt / "dcp-metadata.json"
        meta.write_text(meta.read_text().replace('"shards-00001.safetensors"', '"../../shards-00001.safetensors"'))

    damages = {
        "pickle": lambda ckpt: (ckpt / "shards-00000.safetensors").write_bytes(pickle_bomb),
        "header bomb": lambda ckpt: (ckpt / "shards-00001.safetensors").write_bytes(header_bomb),
        "outside the folder": metadata_outside,
    }
    cfg = load_config(TINY, ["run_dir='unused'"])
    for what, damage in damages.items():
        run_dir = tmp_path / what.replace(" ", "-")
        shutil.copytree(continuous / "checkpoints", run_dir / "checkpoints")
        ckpt = final_checkpoint(run_dir, 8)
        damage(ckpt)
        _match_manifest(ckpt)
        store = CheckpointStore(str(run_dir))
        ref = store.ref(8)
        if what != "outside the folder":  # metadata is JSON that parses: found by the load, below
            assert store.verify(ref), what
        trainer = Trainer(cfg)
        trainer.materialize_optimizer_state()
        with pytest.raises(CheckpointCorrupt):
            load(store, store.open(ref), trainer.state.parts(), verify=Verify.WHILE)
        trainer.close()
    manifest = final_checkpoint(run_dir, 8) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"shards-00000.safetensors"', '"../shards-00000.safetensors"'))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        CheckpointStore(str(run_dir)).open(CheckpointStore(str(run_dir)).ref(8))
    assert not sentinel.exists()


@pytest.mark.slow
def test_resharding_from_world_size_4(tmp_path):
    """Saved by FSDP at world size 4: loaded by FSDP at 4 and 2 and by one process, every
    gathered tensor bitwise equal; each trains on."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = Ranks(("train", str(TINY), "--run-dir", str(run_dir), "--set", "parallel.strategy=fsdp",
                  "--set", "train.steps=8"), nproc=4)
    assert run(args, log) == 0, tail(log)
    ckpt = final_checkpoint(run_dir, 4)
    names = {f["name"] for f in json.loads((ckpt / "manifest.json").read_text())["files"]}
    assert {f"shards-0000{r}.safetensors" for r in range(4)} <= names
    original = gather(ckpt, "fsdp", tmp_path / "fsdp4.safetensors", 4, "train.steps=8")
    for strategy, nproc in (("fsdp", 2), ("ddp", 1)):
        loaded = gather(ckpt, strategy, tmp_path / f"{strategy}{nproc}.safetensors", nproc, "train.steps=8")
        assert sorted(loaded) == sorted(original)
        assert all(same_bits(loaded[k], t) for k, t in original.items()), f"{strategy}@{nproc}"
