"""prefetch.py: a checkpoint's tensor files read into the page cache in a thread while a resume
builds its trainer (residency asked of the kernel with mincore), stopped by `close`, nothing off
local disk. That a real resume prefetches the files it loads: test_resume_reads.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import torch

from harness.checkpoint import CheckpointStore, Prefetch

_libc = ctypes.CDLL(None, use_errno=True)


def resident(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore over a private mapping of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        start = (ctypes.c_char * size).from_buffer(mapped)
        try:
            assert _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) == 0
        finally:
            del start  # the mapping closes only once no buffer refers to it
    return sum(v & 1 for v in vec) / pages


def evict(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_prefetch_reads_a_cold_checkpoint_into_the_page_cache(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    g = torch.Generator().manual_seed(0)
    store.save(1, {"model": {"w": torch.randn(4 << 20, generator=g)},
                   "optim": {"m": torch.randn(4 << 20, generator=g)}})
    checkpoint = store.open(store.ref(1))
    assert checkpoint.tensor_files == ["model.safetensors", "optim.safetensors"]
    files = [Path(checkpoint.ref.path) / name for name in checkpoint.tensor_files]
    evict(files)
    assert max(map(resident, files)) < 0.5
    prefetch = Prefetch(store.loc, checkpoint.ref, checkpoint.tensor_files)
    until(lambda: prefetch.read == sum(f.stat().st_size for f in files))
    prefetch.close()
    assert min(map(resident, files)) > 0.9


def test_prefetch_stops_at_close_and_reads_nothing_off_local_disk(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    store.save(1, {"model": {"w": torch.zeros(4)}})
    ref = store.ref(1)
    os.truncate(Path(ref.path) / "model.safetensors", 4 << 30)  # sparse: 4 GiB of zeros, tenths of a second to read
    with Prefetch(store.loc, ref, ["model.safetensors"]) as prefetch:
        pass
    assert prefetch.read < 4 << 30
    remote = CheckpointStore("memory://prefetch-test")
    remote.save(1, {"model": {"w": torch.zeros(4)}})
    with Prefetch(remote.loc, remote.ref(1), ["model.safetensors"]) as nothing:
        pass
    assert nothing.read == 0
