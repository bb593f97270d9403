"""Large local writes around the page cache (harness/storage/direct_io.py): the bytes, the mode
the filesystem allows, the switch, a failed background write, and a checkpoint written so."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
import torch

from harness.checkpoint import CheckpointStore, load
from harness.checkpoint.loading import Verify
from harness.storage import direct_io
from harness.storage.digest import hexdigest
from harness.storage.direct_io import BUFFER_BYTES, DirectWriter
from harness.storage.filesystem import LocalDiskFileSystem
from harness.storage.location import open_location, write_stream


def _accepts_o_direct(folder) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("size", [0, 1, BUFFER_BYTES - 1, BUFFER_BYTES, BUFFER_BYTES + 1, 3 * BUFFER_BYTES + 12345])
def test_the_file_holds_exactly_the_bytes_written(tmp_path, size):
    data = os.urandom(size)
    with DirectWriter(str(tmp_path / "f")) as f:
        at = 0
        for n in (7, 1 << 20, 5 << 20, 13):  # odd chunk sizes, then the rest
            f.write(memoryview(data)[at:at + n])
            at = min(at + n, size)
        f.write(data[at:])
        f.flush()
        os.fsync(f.fileno())
    assert (tmp_path / "f").read_bytes() == data
    assert f.went_direct is (None if size < BUFFER_BYTES else _accepts_o_direct(tmp_path))


def test_writes_after_a_flush_append(tmp_path):
    data = os.urandom(BUFFER_BYTES + 100)
    f = DirectWriter(str(tmp_path / "f"))
    f.write(data)
    f.flush()
    f.write(b"tail")
    f.close()
    assert (tmp_path / "f").read_bytes() == data + b"tail"


def test_only_a_binary_write_the_caller_marks_direct_goes_around_the_cache(tmp_path, monkeypatch):
    fs = LocalDiskFileSystem()
    assert direct_io.suits(str(tmp_path)) is (os.major(os.stat(tmp_path).st_dev) != 0)
    with fs.open(str(tmp_path / "a"), "wb", direct=True) as f:
        assert isinstance(f, DirectWriter) is direct_io.suits(str(tmp_path))
    with fs.open(str(tmp_path / "b"), "wb") as f:
        assert not isinstance(f, DirectWriter)
    monkeypatch.setenv(direct_io.ENV, "0")
    assert not direct_io.suits(str(tmp_path))
    with fs.open(str(tmp_path / "c"), "wb", direct=True) as f:
        assert not isinstance(f, DirectWriter)


def test_a_tmpfs_is_written_through_its_pages_with_the_hash_behind(tmp_path):
    """A RAM tier's files are its pages: no direct writes there, and write_stream hashes in its
    thread behind the writes (the same digest either way)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        assert not direct_io.suits(shm)
        data = os.urandom(BUFFER_BYTES + 5)
        pieces = [data[:100], memoryview(data)[100:]]
        in_ram = write_stream(open_location(shm), f"{shm}/f", pieces)
        on_disk = write_stream(open_location(str(tmp_path)), f"{tmp_path}/f", pieces)
        assert in_ram == on_disk == (len(data), hexdigest("blake3", data))
        assert Path(shm, "f").read_bytes() == (tmp_path / "f").read_bytes() == data


def test_a_failed_background_write_is_raised_once_and_close_adds_nothing(tmp_path, monkeypatch):
    real = os.pwrite

    def full_disk(fd, data, offset):
        if offset >= BUFFER_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", full_disk)
    f = DirectWriter(str(tmp_path / "f"))
    with pytest.raises(OSError, match="No space left"):
        f.write(os.urandom(2 * BUFFER_BYTES))
        f.flush()
    f.close()  # the failure was raised already: closing neither raises again nor writes the rest
    assert f.closed and os.path.getsize(tmp_path / "f") <= BUFFER_BYTES


def test_a_checkpoint_of_large_tensors_round_trips_verified(tmp_path):
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(1500, 2000)  # 12 MB of weight: more than one buffer
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=g))
    store = CheckpointStore(str(tmp_path / "run"))
    store.save(1, {"model": model})
    fresh = torch.nn.Linear(1500, 2000)
    load(store, store.list()[-1], {"model": fresh}, verify=Verify.WHILE)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
