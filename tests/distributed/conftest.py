"""The distributed tests import their launcher helpers (launch.py) from this folder; `continuous`
is the reference run every interrupted world-size-2 run is compared with, `fsdp_run` the one of
every interrupted FSDP run.

`ARMS` are the optimizers every FSDP guarantee is checked with; the sharded ones (muon, olion,
adafactor) join it once they step on DTensors.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from launch import COMMON, fsdp_args, run, tail  # noqa: E402
from procs import ROOT, TINY  # noqa: E402

ARMS = ["adamw"]


@pytest.fixture(scope="session")
def continuous(tmp_path_factory):
    """The reference run at world size 2, through the launcher users run (ops/torchrun/train.sh)."""
    run_dir = tmp_path_factory.mktemp("continuous")
    log = run_dir.parent / "continuous.log"
    launcher = [str(ROOT / "ops/torchrun/train.sh"), str(TINY), *COMMON]
    assert run(launcher, log, env={"NPROC": "2", "MAX_RESTARTS": "0", "RUN_DIR": str(run_dir)}) == 0, tail(log)
    return run_dir


@pytest.fixture(scope="session", params=ARMS)
def fsdp_run(request, tmp_path_factory):
    """(arm, the continuous FSDP run at world size 2, async saves: the default)."""
    run_dir = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    log = run_dir.parent / f"fsdp-{request.param}.log"
    assert run(fsdp_args(run_dir, request.param), log) == 0, tail(log)
    return request.param, run_dir
