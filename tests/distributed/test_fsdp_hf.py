"""A transformers Llama (`harness.models.hf:causal_lm`, tests/models/data/hf-llama.toml) under FSDP2
at world size 2 (gloo, real processes: launch.Ranks): the group SIGKILLed and resumed is bitwise the
continuous run, and its sharded checkpoint exports (`harness ckpt export --format hf`) the same
bytes as an unsharded checkpoint of the same state."""

from __future__ import annotations

from pathlib import Path

from harness.checkpoint import CheckpointStore
from harness.cli import main
from harness.config import load_config
from harness.models.hf import HF_CONFIG_META
from harness.run.resume import Resume
from launch import Ranks, kill_all, run, start, tail, wait_step
from procs import ROOT, assert_same_run, events, final_checkpoint

HF_LLAMA = ROOT / "tests" / "models" / "data" / "hf-llama.toml"
STEPS = 12


def fsdp_args(run_dir: Path) -> Ranks:
    return Ranks(("train", str(HF_LLAMA), "--run-dir", str(run_dir), "--set", "parallel.strategy=fsdp"))


def unsharded_copy(ckpt: Path, run_dir: Path) -> Path:
    """The model of the sharded checkpoint `ckpt`, loaded by one process the way `harness train`
    resumes (run/resume.py), saved again by that process: an unsharded checkpoint of the same state."""
    cfg = load_config(HF_LLAMA, [f"run_dir='{ckpt.parents[1]}'"])
    started = Resume(cfg, CheckpointStore(cfg.run_dir), str(ckpt)).start()
    trainer, ref = started.trainer, started.chosen.ref
    try:
        CheckpointStore(str(run_dir)).save(ref.step, {"model": trainer.model}, meta={HF_CONFIG_META: trainer.hf_config})
    finally:
        trainer.close()
    return final_checkpoint(run_dir, ref.step)


def test_group_sigkill_resumes_bitwise_and_the_sharded_checkpoint_exports_as_unsharded(tmp_path, capsys):
    continuous, log = tmp_path / "continuous", tmp_path / "continuous.log"
    assert run(fsdp_args(continuous), log) == 0, tail(log)
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    proc = start(fsdp_args(run_dir), log)
    wait_step(proc, run_dir, 6, log, committed=4)
    kill_all(proc)  # both ranks at once
    proc.wait(60)
    assert run(fsdp_args(run_dir), log) == 0, tail(log)
    assert [e["resumed_from"] for e in events(run_dir) if e["event"] == "start"] == [None, 4]
    assert not [e for e in events(run_dir) if e["event"] == "resume_mismatch"]
    assert_same_run(continuous, run_dir, STEPS)

    sharded = final_checkpoint(continuous, 8)  # not the final one: a finished run loads nothing
    assert (sharded / "shards-00001.safetensors").exists() and not (sharded / "model.safetensors").exists()
    unsharded = unsharded_copy(sharded, tmp_path / "unsharded")
    assert (unsharded / "model.safetensors").exists()
    for ckpt, out in ((sharded, tmp_path / "from-sharded"), (unsharded, tmp_path / "from-unsharded")):
        assert main(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(out)]) == 0, capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "from-sharded").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "from-unsharded").iterdir())
    assert "model.safetensors" in names
    for name in names:
        assert ((tmp_path / "from-sharded" / name).read_bytes()
                == (tmp_path / "from-unsharded" / name).read_bytes()), name
