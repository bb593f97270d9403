"""`train.compile`: a compiled run SIGKILLed and resumed (compiled) ends bitwise equal to the same
compiled run uninterrupted; its checkpoints keep the plain parameter names, so an eager process
resumes from them; since compiled kernels round differently, only with --allow-config-change."""

import json
import shutil

import torch
from safetensors import safe_open

from procs import TINY, assert_same_run, events, final_checkpoint, harness, kill_at_step

COMPILED = ["--set", "train.compile=true"]


def test_a_compiled_run_killed_and_resumed_is_bitwise_equal_and_eager_reads_its_checkpoints(tmp_path):
    straight, killed, eager = (tmp_path / name for name in ("straight", "killed", "eager"))
    harness("train", str(TINY), "--run-dir", str(straight), *COMPILED, check=True, timeout=900)
    # A save inside the step loop: the step-4 checkpoint is there when the kill comes.
    sync = ["--set", "checkpoint.async_save=false"]
    assert kill_at_step(["train", str(TINY), "--run-dir", str(killed), *COMPILED, *sync], killed, 6, timeout=900) != 0
    shutil.copytree(killed, eager)  # the same killed run, resumed by an eager process below
    harness("train", str(TINY), "--run-dir", str(killed), *COMPILED, *sync, check=True, timeout=900)
    assert [e["resumed_from"] for e in events(killed, "start")] == [None, 4]
    assert_same_run(straight, killed, 12)
    assert json.loads((straight / "run.json").read_text())["config"]["train"]["compile"] is True

    with safe_open(str(final_checkpoint(straight, 12) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any("_orig_mod" in name for name in names), names

    refused = harness("train", str(TINY), "--run-dir", str(eager), *sync)
    assert refused.returncode == 2 and "train.compile" in refused.stderr, refused.stderr[-3000:]
    resumed = harness("train", str(TINY), "--run-dir", str(eager), *sync, "--allow-config-change", check=True,
                      timeout=900)
    assert "resuming with a changed config" in resumed.stderr and "train.compile" in resumed.stderr
    assert [e["resumed_from"] for e in events(eager, "start")] == [None, 4]


def test_a_compiled_trainer_on_a_cpu_keeps_atens_dropout(monkeypatch):
    """On a CPU the model is compiled with `fallback_random` (inductor's own random numbers made
    the compiled step 1.23-1.42x the eager one's CPU time, harness/run/trainer.py); elsewhere with
    torch's defaults."""
    from harness.config import load_config
    from harness.run import trainer as trainer_module

    seen = []
    monkeypatch.setattr(trainer_module.torch, "compile", lambda net, **kw: seen.append(kw) or net)
    trainer_module.Trainer(load_config(TINY, ["train.compile=true", "train.device=cpu"]))
    assert seen == [{"options": {"fallback_random": True}}]
    assert trainer_module.compile_options(torch.device("cuda")) is None
