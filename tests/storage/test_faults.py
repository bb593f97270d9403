"""The fault layer itself: counting, each mode, the power-loss model, and how it is enabled."""

from __future__ import annotations

import errno
import os

import pytest

from harness.checkpoint import CheckpointStore
from harness.storage.faults import FaultPlan, FaultyFileSystem, SimulatedCrash, wrap_filesystem
from harness.storage.filesystem import LocalDiskFileSystem, open_filesystem
from harness.verify.torture_sweep import tiny_state

pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/conftest.py


def test_plan_parse_and_refusal():
    assert FaultPlan.parse("kill@17") == FaultPlan("kill", 17)
    assert FaultPlan.parse("count") == FaultPlan("count", 0)
    for bad in ("kill", "boom@3", "eio@x", "eio@"):
        with pytest.raises(ValueError, match="MODE@N"):
            FaultPlan.parse(bad)


def test_off_by_default_and_on_by_option_or_env(tmp_path, monkeypatch):
    monkeypatch.delenv("HARNESS_FAULTS", raising=False)
    fs, _ = open_filesystem(str(tmp_path))
    assert type(fs) is LocalDiskFileSystem
    fs, _ = open_filesystem(str(tmp_path), {"faults": "eio@1"})
    assert isinstance(fs, FaultyFileSystem) and fs.injector.plan == FaultPlan("eio", 1)
    monkeypatch.setenv("HARNESS_FAULTS", "enospc@2")
    fs, _ = open_filesystem("memory://faults-env")
    assert isinstance(fs, FaultyFileSystem) and fs.injector.plan == FaultPlan("enospc", 2)


@pytest.mark.parametrize("mode, exc, code", [("eio", OSError, errno.EIO), ("enospc", OSError, errno.ENOSPC),
                                             ("transient", ConnectionResetError, errno.ECONNRESET),
                                             ("permanent", PermissionError, errno.EACCES)])
def test_raise_modes_fire_once_at_n(tmp_path, mode, exc, code):
    fs = wrap_filesystem(LocalDiskFileSystem(), f"{mode}@3")
    path = str(tmp_path / "f")
    with fs.open(path, "wb") as f:          # 1 open
        f.write(b"a")                       # 2 write
        with pytest.raises(exc) as e:
            f.write(b"b")                   # 3: fails, and is not performed
        assert e.value.errno == code and "operation 3" in str(e.value)
        f.write(b"c")                       # 4: one-shot, works again
    assert open(path, "rb").read() == b"ac"
    assert [op for _, op, _ in fs.injector.trace] == ["open", "write", "write", "write"]


def test_every_operation_kind_is_counted(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"), keep_last=2, storage_options={"faults": "count"})
    with store.lease():
        for step in (1, 2, 3):
            store.save(step, tiny_state(step))
    ops = {op for _, op, _ in store.loc.fs.injector.trace}
    assert ops == {"open", "write", "flush", "fsync", "fsync_dir", "rename", "mkdir", "delete", "list"}
    mem = CheckpointStore("memory://faults-count", keep_last=2, storage_options={"faults": "count"})
    mem.save(1, tiny_state(1))
    assert "put" in {op for _, op, _ in mem.loc.fs.injector.trace}


def test_crash_refuses_everything_after_it():
    fs = wrap_filesystem(open_filesystem("memory://faults-crash")[0], "crash@3")
    f = fs.open("/faults-crash/x", "wb")
    f.write(b"abc")
    with pytest.raises(SimulatedCrash):
        f.close()                           # 3: the upload never happens
    with pytest.raises(SimulatedCrash):
        fs.rm("/faults-crash/x")
    f.close()                               # a dead process closes nothing: no error, no effect


def _model(tmp_path):
    fs = wrap_filesystem(LocalDiskFileSystem(), "count")
    return fs, fs.injector.disk


def _write(fs, path, data, sync):
    with fs.open(path, "wb") as f:
        f.write(data)
        if sync:
            fs.fsync(f)


def test_power_loss_drops_unsynced_data_and_undoes_unsynced_renames(tmp_path):
    fs, disk = _model(tmp_path)
    d = str(tmp_path / "d")
    fs.makedirs(d, exist_ok=True)
    fs.fsync_dir(str(tmp_path))
    _write(fs, f"{d}/synced", b"durable", sync=True)
    _write(fs, f"{d}/unsynced", b"lost", sync=False)
    _write(fs, f"{d}/tmp", b"renamed", sync=True)
    fs.fsync_dir(d)
    _write(fs, f"{d}/synced", b"rewritten, not synced", sync=False)
    _write(fs, f"{d}/new", b"never reached the folder", sync=True)
    fs.replace(f"{d}/tmp", f"{d}/final")    # no fsync of d afterwards
    disk.power_loss(torn=False)
    assert open(f"{d}/synced", "rb").read() == b"durable"
    assert open(f"{d}/unsynced", "rb").read() == b""
    assert open(f"{d}/tmp", "rb").read() == b"renamed" and not os.path.exists(f"{d}/final")
    assert not os.path.exists(f"{d}/new")


def test_power_loss_torn_keeps_a_prefix_and_the_metadata(tmp_path):
    fs, disk = _model(tmp_path)
    d = str(tmp_path)
    _write(fs, f"{d}/a", b"12345678", sync=False)
    _write(fs, f"{d}/b", b"kept", sync=True)
    fs.replace(f"{d}/b", f"{d}/c")
    disk.power_loss(torn=True)
    assert open(f"{d}/a", "rb").read() == b"1234"
    assert open(f"{d}/c", "rb").read() == b"kept"
