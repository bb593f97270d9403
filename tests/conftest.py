"""Shared test setup: CPU determinism (one thread, deterministic algorithms, no GPU visible) for every
test, and the fixtures more than one folder uses: the fork servers, a size-limited tmpfs, the S3 test
server on loopback with its fault proxy, quiet logs and a fast scratch folder for the storage-fault
tests, and the uninterrupted tiny.toml run the single-process resume tests compare with."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite checks the CPU guarantees whatever the machine: on a GPU host its configs (train.device
# unset: auto) would train on CUDA, and its 2-rank groups would need a GPU per rank. The GPU paths
# are checked by ops/gpu_check.sh (docs/gpu.md), which runs the suite's GPU cases with
# HARNESS_TESTS_GPU=1 (the GPUs stay visible).
if os.environ.get("HARNESS_TESTS_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import procs  # noqa: E402
from harness.forkserver.pool import ForkServers  # noqa: E402
from harness.log import configure  # noqa: E402


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


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    """tiny.toml run once, uninterrupted, at world size 1 (tests/distributed/conftest.py has its own
    `continuous`, at world size 2)."""
    run_dir = tmp_path_factory.mktemp("continuous") / "run"
    procs.harness("train", str(procs.TINY), "--run-dir", str(run_dir), check=True)
    return run_dir


# S3: one moto server per session on loopback, a fault proxy per test, fake credentials. The
# credentials live only in the environment (where s3fs/boto3 and child processes read them), never
# in storage options, so tests can assert that `FAKE_SECRET` shows up nowhere we write. Storage
# options for a test: s3server.options.

@pytest.fixture(scope="session")
def s3_server():
    from s3server import FAKE_ENV, S3Server

    saved = {k: os.environ.get(k) for k in FAKE_ENV}
    os.environ.update(FAKE_ENV)
    server = S3Server().start()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def proxy(s3_server):
    from s3proxy import FaultProxy

    p = FaultProxy(s3_server.endpoint).start()
    yield p
    p.stop()


@pytest.fixture
def s3_url(s3_server):
    """A fresh prefix in the test bucket for this test."""
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def quiet_logs():
    """For the storage-fault tests (`pytestmark = pytest.mark.usefixtures("quiet_logs")`): a sweep
    provokes thousands of expected warnings (skipped checkpoints, taken-over leases)."""
    configure("error")
    yield
    configure("info")


@pytest.fixture
def scratch(tmp_path) -> Path:
    """A local folder for a sweep, in RAM when the machine has /dev/shm: the store runs the same
    code either way (the power-loss model does the forgetting, not the disk), and a sweep does
    about 30 fsyncs per point, which cost tens of milliseconds each on a shared disk."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="torture-", dir="/dev/shm"))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path
