"""A process that joined a process group ends without the interpreter's finalization
(harness/process/process_end.py): in it, gloo worker threads that outlive the group (DTensor's caches
keep an FSDP mesh's group alive) aborted finished runs with SIGABRT. A single
process still exits normally."""

import subprocess
import sys
from pathlib import Path

import pytest

from harness.forkserver.relay import SERVER_ENV
from launch import run, tail, torchrun
from procs import ENV, ROOT, TINY

PROBE = ["--set", 'model.factory="finalize_probe:build"']
# Fresh ranks (no fork server named: a relay's forked child leaves without finalizing whatever it
# ran, harness/forkserver/child.py), with the probe's folder on their path.
PATH_ENV = {"PYTHONPATH": str(Path(__file__).parent), SERVER_ENV: ""}


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_distributed_run_ends_without_finalizing(tmp_path, strategy):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = torchrun("train", str(TINY), "--run-dir", str(run_dir), "--set", f"parallel.strategy={strategy}",
                    "--set", "train.steps=4", "--log-level", "debug", *PROBE)
    assert run(args, log, env=PATH_ENV) == 0, tail(log)
    text = log.read_text()
    # Both ranks report `finished` (other ranks than 0 print info lines at debug level only).
    assert text.count("finished") >= 2 and "interpreter finalized" not in text, tail(log)


def test_a_user_error_under_torchrun_keeps_its_exit_code(tmp_path):
    log = tmp_path / "torchrun.log"
    args = torchrun("train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", "parallel.strategy=fsdp",
                    "--set", "parallel.shard_modules='nomatch'", *PROBE)
    assert run(args, log, env=PATH_ENV) != 0
    text = log.read_text()
    assert "matches no module" in text and "exitcode  : 2" in text and "interpreter finalized" not in text, tail(log)


def test_a_single_process_still_finalizes(tmp_path):
    # A fresh interpreter, not one from the test session's fork server: a forked child leaves
    # without finalizing whatever it ran (harness/forkserver/child.py).
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(TINY), "--run-dir", str(tmp_path / "run"),
                           "--set", "train.steps=2", *PROBE], env={**ENV, **PATH_ENV}, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interpreter finalized" in proc.stderr
