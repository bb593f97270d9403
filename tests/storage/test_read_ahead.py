"""read_ahead.py: a file read through `ReadAhead` gives the file's bytes, and the kernel is asked
for the bytes ahead of each read, a bounded distance, never for the bytes a seek skipped."""

from __future__ import annotations

import io
import os

import pytest

from harness.storage import read_ahead
from harness.storage.read_ahead import ReadAhead

MIB = 1 << 20


@pytest.fixture
def log(monkeypatch):
    """Small windows (1 MiB, at most 4 MiB ahead); every advice given, as ("advice", offset, end)."""
    monkeypatch.setattr(read_ahead, "WINDOW_BYTES", MIB)
    monkeypatch.setattr(read_ahead, "AHEAD_BYTES", 4 * MIB)
    events: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, how: int) -> None:
        assert how == os.POSIX_FADV_WILLNEED
        events.append(("advice", offset, offset + length))
        real(fd, offset, length, how)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return events


class Logged(io.FileIO):
    """The file, its reads logged beside the advice: ("read", start, end)."""

    def __init__(self, path, events) -> None:
        super().__init__(path, "rb")
        self.events = events

    def readinto(self, view) -> int:
        start = self.tell()
        got = super().readinto(view)
        self.events.append(("read", start, start + got))
        return got


def test_the_bytes_read_are_the_files_and_each_read_was_asked_for_ahead(tmp_path, log):
    data = os.urandom(40 * MIB + 123)
    (tmp_path / "f").write_bytes(data)
    got = bytearray()
    with ReadAhead(Logged(tmp_path / "f", log)) as f:
        assert log == [("advice", 0, MIB)]  # one window at the open
        while n := f.readinto(piece := bytearray(3 * MIB)):
            got += piece[:n]
    assert bytes(got) == data
    advised = 0
    for kind, start, end in log:
        if kind == "advice":
            assert start == advised  # every window once, in order
            advised = end
        elif end > start:
            assert advised >= min(end, len(data))  # asked for before it was read
            assert advised <= end + 4 * MIB + MIB  # and no further than the bound
    assert advised >= len(data)


def test_a_seek_skips_the_advice_and_a_header_read_asks_for_little(tmp_path, log):
    (tmp_path / "f").write_bytes(os.urandom(64 * MIB))
    with ReadAhead(open(tmp_path / "f", "rb", buffering=0)) as f:
        assert len(f.read(8)) == 8
        assert max(end for _, _, end in log) <= 2 * MIB  # the kernel's own window and one more
        f.seek(40 * MIB)
        assert f.read(MIB) and f.tell() == 41 * MIB
    assert not [start for _, start, _ in log if 2 * MIB <= start < 40 * MIB]
