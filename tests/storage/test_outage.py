"""A storage outage is an outage: the S3 endpoint frozen mid-run (the server process SIGSTOPped: a
black hole that accepts connections and never answers) or unreachable at start ends the run with
STORAGE_UNAVAILABLE (69), one line naming the endpoint and the operation, the lease intact (never
read as "malformed" or "gone"); started again once the endpoint is back, the run resumes and
finishes bitwise equal to a run never interrupted."""

from __future__ import annotations

import json

import pytest

import procs
from harness import exit_codes
from procs import TINY, assert_same_run, harness, start, wait_for_step
from s3server import FAKE_ENV, S3ServerProcess, download_final

STEPS = 12
# Short deadlines so an outage is declared within seconds; heartbeats often, so one is due mid-run.
OUTAGE_OPTIONS = [
    "--set", "checkpoint.storage_options.retry={attempts=50, initial=0.05, max_wait=0.5, deadline_s=4}",
    "--set", "checkpoint.storage_options.config_kwargs={connect_timeout=1, read_timeout=1}",
    "--set", "checkpoint.lease_heartbeat_s=0.5",
]


@pytest.fixture(scope="module")
def server():
    srv = S3ServerProcess().start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module", autouse=True)
def fake_credentials():
    """The child processes find the fake credentials in their environment, for this module only."""
    with pytest.MonkeyPatch.context() as patch:
        for k, v in FAKE_ENV.items():
            patch.setitem(procs.ENV, k, v)
        yield


@pytest.fixture(scope="module")
def continuous(server, tmp_path_factory):
    """A run never interrupted, on the same endpoint: the reference for bitwise equality."""
    log = tmp_path_factory.mktemp("continuous")
    url = f"s3://{server.bucket}/continuous"
    harness(*train_args(server.endpoint, url, log), check=True)
    download_final(server.client(), server.bucket, url, STEPS, log)
    return log


def train_args(endpoint: str, url: str, log) -> list[str]:
    return ["train", str(TINY), "--run-dir", url, "--set", f"log_dir={log}",
            "--set", f'checkpoint.storage_options.endpoint_url="{endpoint}"', *OUTAGE_OPTIONS]


def assert_outage_reported(proc_code: int, stderr: str, endpoint: str) -> None:
    assert proc_code == exit_codes.STORAGE_UNAVAILABLE, stderr[-2000:]
    [line] = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert f"storage endpoint {endpoint} unavailable" in line and "S3 " in line
    assert "malformed" not in stderr and "lost the lease" not in stderr and "Traceback" not in stderr


def test_endpoint_frozen_mid_run_exits_retryable_and_resumes_bitwise(server, continuous, tmp_path):
    url, log = f"s3://{server.bucket}/frozen", tmp_path / "frozen"
    args = train_args(server.endpoint, url, log)
    proc = start(*args, "--set", "debug.step_sleep_s=0.2")
    wait_for_step(proc, log, 6)  # the checkpoint of step 4 is committed or in flight
    server.freeze()
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        server.thaw()
    assert_outage_reported(proc.returncode, stderr, server.endpoint)

    lease = json.loads(server.client().get_object(Bucket=server.bucket, Key="frozen/lease.json")["Body"].read())
    assert lease["pid"] == proc.pid  # intact: still the stopped writer's record, taken over below

    resumed = harness(*args, check=True)
    assert "taking over the run dir lease" in resumed.stdout + resumed.stderr
    download_final(server.client(), server.bucket, url, STEPS, log)
    assert_same_run(continuous, log, STEPS)


def test_endpoint_unreachable_at_start_exits_retryable_then_runs(server, continuous, tmp_path):
    absent = S3ServerProcess()  # a free port nothing listens on
    url, log = f"s3://{server.bucket}/unreachable", tmp_path / "unreachable"
    down = harness(*train_args(absent.endpoint, url, log))
    assert_outage_reported(down.returncode, down.stderr, absent.endpoint)

    harness(*train_args(server.endpoint, url, log), check=True)
    download_final(server.client(), server.bucket, url, STEPS, log)
    assert_same_run(continuous, log, STEPS)
