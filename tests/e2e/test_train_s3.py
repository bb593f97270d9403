"""Interrupted vs continuous training with the run dir on s3://, a quarter of all S3 requests
faulted by the proxy: SIGKILLed twice and resumed, the run finishes bitwise equal to a run never
interrupted, and the fake secret appears in no object, log file or process output."""

from __future__ import annotations

import procs
from procs import TINY, assert_same_run, harness, kill_at_step
from s3proxy import FaultPlan
from s3server import FAKE_ENV, FAKE_KEY, FAKE_SECRET, download_final

STEPS = 12


def test_sigkill_resume_on_s3_with_faults_is_bitwise(proxy, s3_server, s3_url, tmp_path, monkeypatch):
    for k, v in FAKE_ENV.items():
        monkeypatch.setitem(procs.ENV, k, v)
    proxy.plan = FaultPlan(rate=0.25, seed=5)
    endpoint = ["--set", f"checkpoint.storage_options.endpoint_url={proxy.endpoint}"]
    cont_url, intr_url = f"{s3_url}/continuous", f"{s3_url}/interrupted"
    cont_log, intr_log = tmp_path / "continuous", tmp_path / "interrupted"

    done = harness("train", str(TINY), "--run-dir", cont_url, "--set", f"log_dir={cont_log}", *endpoint, check=True)
    args = ["train", str(TINY), "--run-dir", intr_url, "--set", f"log_dir={intr_log}", *endpoint]
    for step in (6, 10):  # after the first checkpoint (step 4), and after the second
        assert kill_at_step(args, intr_log, step) != 0, "the process finished before it could be killed"
    resumed = harness(*args, check=True)
    assert sum(proxy.faults.values()) >= 20, proxy.faults

    download_final(s3_server.client(), s3_server.bucket, cont_url, STEPS, cont_log)
    download_final(s3_server.client(), s3_server.bucket, intr_url, STEPS, intr_log)
    assert_same_run(cont_log, intr_log, STEPS)
    assert s3_server.open_multipart_uploads() == []

    client = s3_server.client()
    written = [client.get_object(Bucket=s3_server.bucket, Key=k)["Body"].read()
               for k in s3_server.keys(s3_url.split("/", 3)[3])]
    written += [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    written += [(p.stdout + p.stderr).encode() for p in (done, resumed)]
    assert any(b"run.json" in k.encode() for k in s3_server.keys(s3_url.split("/", 3)[3]))
    for secret in (FAKE_SECRET, FAKE_KEY):
        assert not any(secret.encode() in blob for blob in written)
