"""Local-first persistence (checkpoint/save/local_first.py) against the moto S3 server: a commit returns once
it is on local disk, the remote manifest is written only after every uploaded object was read back
and matched, a failed upload leaves the previous remote checkpoint the newest good one and is raised
at the next call, and `harness train` with checkpoint.local_dir ends with its final checkpoint
published and verified on S3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import procs
from harness.checkpoint import CheckpointStore, capture
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.save import local_first
from harness.checkpoint.save.local_first import LocalFirst, UploadError
from procs import TINY, harness
from s3proxy import FaultPlan
from s3server import FAKE_ENV, options


def snapshot(step: int):
    torch.manual_seed(step)
    return capture({"model": nn.Linear(64, 64)})


def remote_view(s3_server, url: str) -> CheckpointStore:
    """The run dir as a fresh reader sees it, straight from the server (no proxy, no cache)."""
    store = CheckpointStore(url, storage_options=options(s3_server.endpoint))
    store.loc.fs.invalidate_cache()
    return store


def manifest_key(url: str, step: int) -> str:
    return f"{url.split('/', 3)[3]}/checkpoints/step-{step:08d}/manifest.json"


def test_commit_is_local_then_published_after_every_object_verifies(proxy, s3_server, s3_url, tmp_path, monkeypatch):
    remote = CheckpointStore(s3_url, keep_last=2, storage_options=options(proxy.endpoint))
    commit = LocalFirst(remote, str(tmp_path / "local"))
    events: list[tuple[str, str]] = []
    real_hash, real_seal = local_first.hash_file, remote.seal

    def hash_file(loc, path, algorithm):
        events.append(("verified", path.rsplit("/", 1)[-1]))
        return real_hash(loc, path, algorithm)

    def seal(ref, work, records):
        assert manifest_key(s3_url, ref.step) not in s3_server.keys(s3_url.split("/", 3)[3])
        events.append(("sealed", str(ref.step)))
        return real_seal(ref, work, records)

    monkeypatch.setattr(local_first, "hash_file", hash_file)
    monkeypatch.setattr(remote, "seal", seal)
    proxy.script = ["delay"] * 4  # the upload's first requests are slow: the commit must not wait for them
    ref = commit(1, snapshot(1), meta={"n": 1})
    assert commit.local.latest_good().step == 1
    assert manifest_key(s3_url, 1) not in s3_server.keys(), "published before the upload finished"
    commit.finish()

    names = {r.name for r in commit.local.manifest(commit.local.ref(1)).files}
    assert events[-1] == ("sealed", "1") and {n for kind, n in events[:-1] if kind == "verified"} == names
    view = remote_view(s3_server, s3_url)
    assert view.latest_good() == view.ref(1) and ref.url == view.ref(1).url
    assert view.read_state(view.ref(1))["meta"] == {"n": 1}

    for step in (2, 3, 4):
        commit(step, snapshot(step))
    commit.finish()
    view = remote_view(s3_server, s3_url)
    assert [r.step for r in view.list()] == [3, 4] and view.verify(view.ref(4)) == []
    assert [r.step for r in commit.local.list()] == [3, 4]  # local retention: the last 2
    assert s3_server.open_multipart_uploads() == []


def test_failed_upload_keeps_previous_remote_checkpoint_newest(proxy, s3_server, s3_url, tmp_path, monkeypatch):
    remote = CheckpointStore(s3_url, keep_last=2, storage_options=options(proxy.endpoint, deadline_s=5.0))
    commit = LocalFirst(remote, str(tmp_path / "local"))
    commit(1, snapshot(1))
    commit.finish()

    # An object that reads back wrong: nothing is published, finish raises, once.
    real_hash = local_first.hash_file
    monkeypatch.setattr(local_first, "hash_file", lambda loc, path, algorithm: (
        (0, "0" * 64) if path.endswith("model.safetensors") else real_hash(loc, path, algorithm)))
    commit(2, snapshot(2))
    with pytest.raises(CheckpointError, match="step 2.*fails verification.*previous remote checkpoint"):
        commit.finish()
    commit.finish()
    monkeypatch.setattr(local_first, "hash_file", real_hash)
    assert manifest_key(s3_url, 2) not in s3_server.keys()
    assert remote_view(s3_server, s3_url).latest_good().step == 1

    # S3 refuses every request during the upload: the next commit raises, before writing anything.
    proxy.plan = FaultPlan(rate=1.0, modes=("forbidden403",))
    commit(3, snapshot(3))
    commit.wait()
    proxy.plan = FaultPlan()
    with pytest.raises((CheckpointError, UploadError), match="step 3.*previous remote checkpoint"):
        commit(4, snapshot(4))
    assert [r.step for r in commit.local.list()] == [2, 3]
    view = remote_view(s3_server, s3_url)
    assert [r.step for r in view.list()] == [1] and view.latest_good().step == 1

    commit(4, snapshot(4))  # the error was raised once; uploads work again
    commit.finish()
    assert remote_view(s3_server, s3_url).latest_good().step == 4


def test_train_with_local_dir_publishes_final_checkpoint(proxy, s3_server, s3_url, tmp_path, monkeypatch):
    for k, v in FAKE_ENV.items():
        monkeypatch.setitem(procs.ENV, k, v)
    proxy.plan = FaultPlan(rate=0.1, seed=3)
    local = tmp_path / "local"
    harness("train", str(TINY), "--run-dir", s3_url, "--set", f"log_dir={tmp_path / 'logs'}",
            "--set", f"checkpoint.storage_options.endpoint_url={proxy.endpoint}",
            "--set", f"checkpoint.local_dir={local}", check=True)
    view = remote_view(s3_server, s3_url)
    final = view.latest_good()
    assert final is not None and final.step == 12 and view.verify(final) == []
    assert view.read_state(final)["parts"]["trainer"]["finished"] is True
    assert [r.step for r in view.list()] == [8, 12]
    assert [r.step for r in CheckpointStore(str(local)).list()] == [8, 12]
    assert s3_server.open_multipart_uploads() == []
