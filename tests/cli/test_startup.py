"""Commands that build no optimizer start without DTensor or DCP: importing them costs over a
second of every start, and only sharded checkpoints need them (optim/dtensor.py)."""

from __future__ import annotations

import subprocess
import sys

from torch import nn

from harness.checkpoint import CheckpointStore
from procs import ENV, ROOT

SHARDING_ONLY = {"torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp"}


def modules_imported(*args: str) -> set[str]:
    """The modules `harness ARGS` imported (python -X importtime), after checking it succeeded."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness.cli", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


def test_checkpoint_commands_load_no_sharding_modules(tmp_path):
    ref = CheckpointStore(str(tmp_path)).save(1, {"model": nn.Linear(4, 4)})
    for args in (["ckpt", "diff", ref.url, ref.url], ["ckpt", "verify", str(tmp_path)], ["--help"]):
        imported = modules_imported(*args)
        assert "torch" in imported and "harness.checkpoint.loading" in imported  # the check can see imports
        assert not imported & SHARDING_ONLY, (args, imported & SHARDING_ONLY)
