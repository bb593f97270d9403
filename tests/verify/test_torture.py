"""The operation sweep: a fault at every storage operation of a save, every mode, each store.

Acceptance: 0 lost checkpoints, 0 corrupt checkpoints accepted, 0 unclean recoveries; and the
sweep must be able to fail (mutant stores below). Counts are recorded in docs/torture.md.
"""

from __future__ import annotations

import uuid

import pytest

import harness.checkpoint.store as store_module
from harness.checkpoint import CheckpointStore
from harness.cli import main
from harness.verify.torture_sweep import ALL_MODES, Torture, corruption_sweep, format_table
from s3server import options

pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/conftest.py


def _assert_clean(torture: Torture, tallies) -> None:
    table = format_table(torture.kind, tallies)
    print("\n" + table)
    failures = [f"{p.result}: {p.mode}@{p.at} ({p.op}): {p.detail}" for t in tallies.values() for p in t.failures]
    assert not failures, table + "\n" + "\n".join(failures)


def test_local_full_sweep_every_mode(scratch):
    torture = Torture(str(scratch / "run"))
    tallies = torture.sweep(ALL_MODES)
    _assert_clean(torture, tallies)
    assert all(t.tried >= 30 for t in tallies.values())
    # Both outcomes happen: some points lose only the new save, some keep it.
    assert 0 < tallies["powerloss"].kept_new < tallies["powerloss"].tried


def test_memory_full_sweep_every_mode():
    torture = Torture(f"memory://torture-{uuid.uuid4().hex[:8]}")
    tallies = torture.sweep(ALL_MODES)
    _assert_clean(torture, tallies)
    assert all(t.tried >= 20 for t in tallies.values())


def test_s3_sampled_sweep(s3_server):
    torture = Torture(f"s3://{s3_server.bucket}/torture-{uuid.uuid4().hex[:8]}",
                      options(s3_server.endpoint, attempts=2, deadline_s=5.0))
    tallies = torture.sweep(("kill", "eio", "transient"), points=4)  # ~4 s a point against moto
    _assert_clean(torture, tallies)


def test_sweep_catches_a_store_that_accepts_without_verifying(monkeypatch):
    monkeypatch.setattr(CheckpointStore, "verify", lambda self, ref: [])
    torture = Torture(f"memory://torture-mutant-{uuid.uuid4().hex[:8]}")
    tally = torture.sweep(("kill",))["kill"]
    assert tally.wrongly_accepted > 0


def test_sweep_catches_a_commit_without_folder_fsync(scratch, monkeypatch):
    monkeypatch.setattr(store_module, "fsync_dir", lambda loc, path: None)
    torture = Torture(str(scratch / "run"))
    tally = torture.sweep(("powerloss",))["powerloss"]
    assert tally.lost > 0, "a rename that never reached the disk must lose a committed checkpoint"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_corruption_sweep_every_file(scratch, where):
    url = str(scratch / "run") if where == "local" else f"memory://torture-corrupt-{uuid.uuid4().hex[:8]}"
    result = corruption_sweep(Torture(url), offsets=16)
    print(f"\n{where}: {result.cases} damaged files, {result.detected} detected, {result.named} named, "
          f"{result.fell_back} fell back, {result.cli_failed} failed `harness ckpt verify`")
    assert result.cases >= 60 and not result.misses
    assert result.detected == result.named == result.fell_back == result.cli_failed == result.cases


def test_torture_command_prints_the_table(scratch, capsys):
    code = main(["torture", str(scratch / "run"), "--points", "5", "--modes", "kill,eio", "--corruption"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "wrongly accepted" in out and "recovered" in out
    assert "local    kill            5         5     0                0       0" in out
    assert "corruption: " in out
