"""The collectives of harness.parallel.distributed and Muon under DDP, in two real gloo processes."""

from pathlib import Path

from launch import Ranks, run, tail
from procs import TINY


def test_collectives_and_muon_update_identical_on_every_rank(tmp_path):
    worker = Path(__file__).with_name("ddp_worker.py")
    log = tmp_path / "worker.log"
    assert run(Ranks((str(TINY),), script=str(worker)), log) == 0, tail(log)
    assert "rank 0: ok" in log.read_text() and "rank 1: ok" in log.read_text()
