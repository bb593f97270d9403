"""Torture fixtures: a fast local scratch folder, quiet logs, and the S3 test server (tests/s3)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.log import configure
from s3.conftest import s3_server  # noqa: F401  (the moto server on loopback, one per session)


@pytest.fixture(autouse=True)
def quiet_logs():
    """A sweep provokes thousands of expected warnings (skipped checkpoints, taken-over leases)."""
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
