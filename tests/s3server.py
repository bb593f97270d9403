"""A real S3 endpoint for tests: moto's threaded HTTP server on 127.0.0.1, one bucket, fake keys.

`S3Server` starts moto's `ThreadedMotoServer` on a free loopback port, creates `bucket` through
boto3 and exposes `endpoint` (http://127.0.0.1:PORT). `FAKE_ENV` holds recognisable fake
credentials; tests put them in the environment (where s3fs, boto3 and child processes find them)
and grep written objects and logs for `FAKE_SECRET` to prove it never leaks.
`S3ServerProcess` runs the same server as a separate process (ops/s3/local_server.py) that a test
can freeze with SIGSTOP and thaw with SIGCONT. `options` are a test's storage options for an endpoint.
The fixtures (`s3_server`, `proxy`, `s3_url`) are in tests/conftest.py.
`AWS_EC2_METADATA_DISABLED` stops botocore from probing the instance metadata service, which
would add seconds of connect timeouts on a machine without it.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

LOCAL_SERVER = Path(__file__).resolve().parents[1] / "ops" / "s3" / "local_server.py"
FAKE_KEY = "AKIAHARNESSTESTKEY01"
FAKE_SECRET = "harness-test-secret-2f9c1d7e4b"
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_KEY,
    "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class S3Server:
    """moto's S3 on 127.0.0.1:PORT (PORT free, chosen by the OS unless given)."""

    def __init__(self, bucket: str = "harness-test", port: int = 0):
        self.bucket = bucket
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.endpoint = ""

    def start(self) -> S3Server:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        self._server.stop()

    def client(self, endpoint: str | None = None):
        """A boto3 S3 client on this server (or on `endpoint`, e.g. a proxy in front of it)."""
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1",
                            aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def open_multipart_uploads(self) -> list[dict]:
        return self.client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])


class S3ServerProcess:
    """`ops/s3/local_server.py` in its own process on a free loopback port, so a test can freeze
    the endpoint for real (`freeze`: SIGSTOP, a black hole that accepts connections and never
    answers; `thaw`: SIGCONT) or take it away (`stop`). Objects live in that process's memory."""

    def __init__(self, bucket: str = "harness-test") -> None:
        self.bucket = bucket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    def start(self) -> S3ServerProcess:
        self._proc = subprocess.Popen([sys.executable, str(LOCAL_SERVER), "--port", str(self.port),
                                       "--bucket", self.bucket],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self._proc.stdout.readline()  # printed once the bucket exists
        if not line.startswith("S3 server on"):
            self.stop()
            raise RuntimeError(f"the local S3 server did not start: {line!r}")
        return self

    def freeze(self) -> None:
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.kill()
            self._proc.wait()

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET)


def download_final(client, bucket: str, url: str, step: int, log_dir: Path) -> None:
    """Copy checkpoint `step` of the S3 run dir `url` next to the run's local metrics, the layout
    `procs.assert_same_run` reads."""
    prefix = url.split("/", 3)[3] + f"/checkpoints/step-{step:08d}/"
    dest = Path(log_dir) / "checkpoints" / f"step-{step:08d}"
    dest.mkdir(parents=True)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for key in (obj["Key"] for page in pages for obj in page.get("Contents", [])):
        client.download_file(bucket, key, str(dest / key.removeprefix(prefix)))


def options(endpoint: str, deadline_s: float = 20.0, attempts: int = 8, read_timeout: float = 5.0, **extra) -> dict:
    """Storage options for a test: through `endpoint`, quick backoff, short timeouts."""
    return {"endpoint_url": endpoint, "retry": {"attempts": attempts, "initial": 0.02, "max_wait": 0.2,
                                                "deadline_s": deadline_s},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": read_timeout}, **extra}
