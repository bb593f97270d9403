"""A real S3 endpoint for tests: moto's threaded HTTP server on 127.0.0.1, one bucket, fake keys.

`S3Server` starts moto's `ThreadedMotoServer` on a free loopback port, creates `bucket` through
boto3 and exposes `endpoint` (http://127.0.0.1:PORT). `FAKE_ENV` holds recognisable fake
credentials; tests put them in the environment (where s3fs, boto3 and child processes find them)
and grep written objects and logs for `FAKE_SECRET` to prove it never leaks.
`AWS_EC2_METADATA_DISABLED` stops botocore from probing the instance metadata service, which
would add seconds of connect timeouts on a machine without it.
"""

from __future__ import annotations

import logging

import boto3
from moto.server import ThreadedMotoServer

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
