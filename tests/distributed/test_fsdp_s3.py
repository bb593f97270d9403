"""FSDP at world size 2 (torchrun, gloo) with the run dir on s3:// (moto on loopback): each rank
writes its shards straight to the bucket, the manifest lists them; one process resumes from
that sharded checkpoint (resharding, read back from S3, verified while loading) and trains on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import ENV, ROOT, TINY, events, finished, harness, spawn
from s3server import FAKE_ENV


def test_fsdp_shards_on_s3_resume_in_one_process(s3_server, s3_url, tmp_path):
    env = {**ENV, **FAKE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = ["train", str(TINY), "--run-dir", s3_url, "--set", f"log_dir={tmp_path}",
            "--set", f"checkpoint.storage_options.endpoint_url={s3_server.endpoint}"]
    trainer = str(Path(sys.executable).with_name("harness"))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
                trainer, *args, "--set", "parallel.strategy=fsdp", "--set", "train.steps=8"]
    done = finished(spawn(launcher, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prefix = s3_url.split("/", 3)[3] + "/checkpoints/step-00000008/"
    keys = {k.rsplit("/", 1)[1] for k in s3_server.keys(prefix)}
    assert {"shards-00000.safetensors", "shards-00001.safetensors", "dcp-metadata.json", "manifest.json"} <= keys
    assert s3_server.open_multipart_uploads() == []

    harness(*args, "--set", "train.steps=10", "--allow-config-change", env=env, check=True)
    starts = events(tmp_path, "start")
    assert [e["resumed_from"] for e in starts] == [None, 8]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 10
