"""Shared test setup: CPU determinism (one thread, deterministic algorithms) for every test."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


import subprocess  # noqa: E402

import pytest  # noqa: E402

import procs  # noqa: E402
from harness.forkserver import ForkServers  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def fork_servers():
    """This session's (xdist worker's) fork servers for the `harness` processes tests/procs.py
    starts: torch imported once per server instead of once per process, about 6 CPU-seconds each
    (docs/bench-runs.md). HARNESS_TESTS_FRESH=1 starts every process as a fresh interpreter."""
    if os.environ.get("HARNESS_TESTS_FRESH") == "1":
        yield None
        return
    procs.SERVERS = servers = ForkServers(procs.ROOT)
    yield servers
    procs.SERVERS = None
    servers.close()


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size_kib)` -> a fresh size-limited tmpfs folder (a real full disk; remount it
    read-only with `subprocess.run(["mount", "-o", "remount,ro", path])`). Skips the test where
    this machine does not let us mount (tests run as root here)."""
    mounted = []

    def mount(size_kib: int):
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here ({proc.stderr.strip()})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
