"""Commands that build no optimizer start without DTensor or DCP: importing them costs over a
second of every start, and only sharded checkpoints need them (optim/dtensor.py). A config is
read and checked without torch, so a mistake in it is reported before three CPU-seconds of
imports (harness/config.py, optim/config.py)."""

from __future__ import annotations

import subprocess
import sys

from torch import nn

from harness.checkpoint import CheckpointStore
from procs import ENV, ROOT, TINY

SHARDING_ONLY = {"torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp"}


def modules_imported(*args: str, exit_code: int = 0) -> set[str]:
    """The modules `harness ARGS` imported (python -X importtime), after checking its exit code."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.cli", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


def test_checkpoint_commands_load_no_sharding_modules(tmp_path):
    ref = CheckpointStore(str(tmp_path)).save(1, {"model": nn.Linear(4, 4)})
    for args in (["ckpt", "diff", ref.url, ref.url], ["ckpt", "verify", str(tmp_path)], ["--help"]):
        imported = modules_imported(*args)
        assert "torch" in imported and "harness.checkpoint.loading" in imported  # the check can see imports
        assert not imported & SHARDING_ONLY, (args, imported & SHARDING_ONLY)


def test_a_config_mistake_is_reported_before_torch_is_imported(tmp_path):
    for mistake in ("optim.lrr=1", "optim.type=adam", "checkpoint.every_steps=-1"):
        imported = modules_imported("train", str(TINY), "--run-dir", str(tmp_path), "--set", mistake, exit_code=2)
        assert "harness.config" in imported and "optim.config" in imported  # the check can see imports
        assert "torch" not in imported, mistake
    assert "torch" in modules_imported("train", str(TINY), "--run-dir", str(tmp_path), "--set", "train.steps=1")
