"""storage.py: HashingReader hashes exactly the bytes of the file, whatever way they are read."""

from __future__ import annotations

import hashlib
import io

import pytest

from harness.checkpoint import storage
from harness.checkpoint.storage import HashingReader, hash_file, open_location


class ShortReads(io.BytesIO):
    """A file whose `readinto` returns fewer bytes than asked, as sockets and S3 bodies do."""

    def readinto(self, view) -> int:
        return super().readinto(view[:3])


@pytest.mark.parametrize("backlog", [1 << 30, 5])
def test_every_byte_is_hashed_once_in_order_however_it_is_read(monkeypatch, backlog):
    monkeypatch.setattr(storage, "_HASH_BACKLOG_BYTES", backlog)  # 5: wait on the hasher at every read
    data = bytes(range(256)) * 40
    buffers = []
    with HashingReader(ShortReads(data)) as r:
        assert r.read(8) == data[:8]
        r.seek(100)  # forward over bytes nobody reads: still hashed
        view = memoryview(bytearray(50))
        got = r.readinto(view)
        buffers.append(bytes(view[:got]))
        r.seek(r.tell())
        assert r.tell() == 100 + got
        size, sha = r.finish()
    assert buffers == [data[100:100 + got]] and got == 3
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())


def test_it_refuses_to_seek_backwards():
    with HashingReader(io.BytesIO(b"x" * 10)) as r:
        r.read(5)
        with pytest.raises(ValueError, match="only moves forward"):
            r.seek(2)


def test_hash_file_matches_hashlib_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_READ_CHUNK", 7)
    data = bytes(range(256)) * 3 + b"tail"
    (tmp_path / "f").write_bytes(data)
    assert hash_file(open_location(str(tmp_path)), str(tmp_path / "f")) == (len(data), hashlib.sha256(data).hexdigest())
