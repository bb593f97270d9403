"""location.py and digest.py: HashingReader hashes exactly the bytes of the file, whatever way they
are read, under every algorithm a manifest can name, on any number of threads."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys

import blake3
import pytest
from structlog.testing import capture_logs

from harness.storage import location
from harness.storage.digest import ALGORITHMS, DEFAULT_ALGORITHM, hexdigest, new_hasher
from harness.storage.location import HashingReader, hash_file, open_location, write_stream
from procs import ENV, ROOT

# Reference digests straight from the libraries, not through digest.py.
REFERENCE = {"blake3": lambda data: blake3.blake3(data).hexdigest(),
             "sha256": lambda data: hashlib.sha256(data).hexdigest()}


def test_storage_options_for_a_local_path_are_ignored_with_one_warning(tmp_path):
    """A local path takes no storage options (`faults`, the debug option, aside): given some, it
    says they are ignored, once per process, rather than dropping them silently."""
    url = str(tmp_path / "run")
    with capture_logs() as logs:
        for _ in range(2):
            assert open_location(url, {"endpoint_url": "http://x", "bogus": 1}).is_local
        open_location(str(tmp_path / "other"), {"faults": "count"})
    warned = [r for r in logs if r["event"].startswith("storage options ignored")]
    assert [(r["log_level"], r["options"], r["path"]) for r in warned] == [("warning", ["bogus", "endpoint_url"], url)]


def test_every_algorithm_a_manifest_can_name_has_a_reference():
    assert set(ALGORITHMS) == set(REFERENCE) and DEFAULT_ALGORITHM == "blake3"


class ShortReads(io.BytesIO):
    """A file whose `readinto` returns fewer bytes than asked, as sockets and S3 bodies do."""

    def readinto(self, view) -> int:
        return super().readinto(view[:3])


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
@pytest.mark.parametrize("backlog", [1 << 30, 5])
def test_every_byte_is_hashed_once_in_order_however_it_is_read(monkeypatch, backlog, algorithm):
    monkeypatch.setattr(location, "_HASH_BACKLOG_BYTES", backlog)  # 5: wait on the hasher at every read
    data = bytes(range(256)) * 40
    buffers = []
    with HashingReader(ShortReads(data), algorithm) as r:
        assert r.read(8) == data[:8]
        r.seek(100)  # forward over bytes nobody reads: still hashed
        view = memoryview(bytearray(50))
        got = r.readinto(view)
        buffers.append(bytes(view[:got]))
        r.seek(r.tell())
        assert r.tell() == 100 + got
        size, sha = r.finish()
    assert buffers == [data[100:100 + got]] and got == 3
    assert (size, sha) == (len(data), REFERENCE[algorithm](data))


def test_it_refuses_to_seek_backwards():
    with HashingReader(io.BytesIO(b"x" * 10)) as r:
        r.read(5)
        with pytest.raises(ValueError, match="only moves forward"):
            r.seek(2)


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
def test_hash_file_matches_the_library_across_chunk_boundaries(tmp_path, monkeypatch, algorithm):
    monkeypatch.setattr(location, "_READ_CHUNK", 7)
    data = bytes(range(256)) * 3 + b"tail"
    (tmp_path / "f").write_bytes(data)
    expected = (len(data), REFERENCE[algorithm](data))
    assert hash_file(open_location(str(tmp_path)), str(tmp_path / "f"), algorithm) == expected


def test_write_stream_returns_the_default_algorithms_digest_of_what_it_wrote(tmp_path):
    chunks = [b"a" * 1000, memoryview(bytes(range(256)) * 5), b"", b"end"]
    data = b"".join(bytes(c) for c in chunks)
    loc = open_location(str(tmp_path))
    assert write_stream(loc, str(tmp_path / "f"), chunks) == (len(data), REFERENCE[DEFAULT_ALGORITHM](data))
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("threads", [1, 2, 3, None])
def test_a_digest_does_not_depend_on_the_threads_that_computed_it(threads):
    # Old manifests were hashed over every core (blake3's AUTO); they must verify on any count.
    data = bytes(range(256)) * (12 << 10)  # 3 MiB: large enough for blake3 to split
    h = new_hasher("blake3", threads)
    h.update(data[:1000])
    h.update(memoryview(data)[1000:])
    assert h.hexdigest() == REFERENCE["blake3"](data) == blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    assert hexdigest("blake3", data) == hexdigest("blake3", data[:100] + data[100:]) == REFERENCE["blake3"](data)


SHOW_HASH_THREADS = "import os, sys; os.sched_setaffinity(0, set(map(int, sys.argv[1:]))); " \
                    "from harness.storage.digest import hash_threads; print(hash_threads())"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_hash_leaves_one_of_the_cores_it_may_use_to_the_reader():
    cpus = sorted(os.sched_getaffinity(0))

    def threads(*allowed: int) -> int:
        out = subprocess.run([sys.executable, "-c", SHOW_HASH_THREADS, *map(str, allowed)], capture_output=True,
                             text=True, check=True, cwd=ROOT, env=ENV)
        return int(out.stdout)

    assert threads(cpus[0]) == 1
    assert threads(*cpus) == len(cpus) - 1
