"""No cloud credentials at all is a one-line error naming the fix, exit 2
(botocore's NoCredentialsError was a traceback and exit 1)."""

import os
import subprocess

from procs import ENV, TINY, assert_one_line_error, finished, popen


def test_train_without_credentials_is_one_line_exit_2(s3_server, s3_url):
    env = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_CONFIG_FILE=os.devnull, AWS_DEFAULT_REGION="us-east-1")
    for argv in (["train", str(TINY), "--run-dir", s3_url, "--set", "train.steps=2",
                  "--set", f'checkpoint.storage_options.endpoint_url="{s3_server.endpoint}"'],
                 ["ckpt", "ls", s3_url, "-o", f"endpoint_url={s3_server.endpoint}"]):
        proc = finished(popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        assert_one_line_error(proc, "no credentials for s3://")
        assert "AWS_ACCESS_KEY_ID" in proc.stderr and s3_server.endpoint in proc.stderr
