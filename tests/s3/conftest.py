"""S3 fixtures: one moto server per session on loopback, a fault proxy per test, fake credentials.

The credentials live only in the environment (where s3fs/boto3 and child processes read them),
never in storage options, so tests can assert that `FAKE_SECRET` shows up nowhere we write.
"""

from __future__ import annotations

import os
import uuid

import pytest

from s3proxy import FaultProxy
from s3server import FAKE_ENV, S3Server


@pytest.fixture(scope="session")
def s3_server():
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
    p = FaultProxy(s3_server.endpoint).start()
    yield p
    p.stop()


@pytest.fixture
def s3_url(s3_server):
    """A fresh prefix in the test bucket for this test."""
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:12]}"


def options(endpoint: str, deadline_s: float = 20.0, attempts: int = 8, read_timeout: float = 5.0, **extra) -> dict:
    """Storage options for a test: through `endpoint`, quick backoff, short timeouts."""
    return {"endpoint_url": endpoint, "retry": {"attempts": attempts, "initial": 0.02, "max_wait": 0.2,
                                                "deadline_s": deadline_s},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": read_timeout}, **extra}
