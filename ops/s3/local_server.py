"""A local S3 server for trying the S3 path on a laptop: moto's server mode on loopback.

    python ops/s3/local_server.py [--port 5555] [--bucket harness-runs]

Starts moto on 127.0.0.1:PORT, creates BUCKET, prints the environment and the `harness train`
command to use, and serves until Ctrl-C. Needs the `s3-local` extra, which the README's plain
install leaves out: `pip install -e '.[s3-local]'` (the `test` extra has it too).
Everything lives in this process's memory: stopping the server deletes every object. The
credentials printed are moto's placeholders; moto accepts any.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import boto3
    from moto.server import ThreadedMotoServer
except ImportError as e:
    print(f"error: {e.name} is not installed; the local S3 server needs the s3-local extra: "
          "pip install -e '.[s3-local]' (from the repository root)", file=sys.stderr)
    sys.exit(2)

PLACEHOLDER_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probe (seconds of timeouts off EC2)
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--bucket", default="harness-runs")
    args = parser.parse_args()

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{args.port}"
    os.environ.update(PLACEHOLDER_ENV)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=args.bucket)

    exports = "\n".join(f"export {k}={v}" for k, v in PLACEHOLDER_ENV.items())
    print(f"S3 server on {endpoint}, bucket {args.bucket!r} (in memory; Ctrl-C stops it and deletes everything)\n\n"
          f"In another shell:\n{exports}\n"
          f"harness train configs/s3-example.toml --run-dir s3://{args.bucket}/quickstart "
          f"--set checkpoint.storage_options.endpoint_url={endpoint}\n", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
