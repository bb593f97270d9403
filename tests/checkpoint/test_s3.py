"""The store on a real S3 endpoint (moto on loopback): commit, discovery, loading, retention, lease."""

from __future__ import annotations

import uuid

import pytest

from harness.checkpoint import CheckpointStore, load

from .conftest import state_of, torch_state

s3server = pytest.importorskip("s3server")


@pytest.fixture(scope="module")
def s3(request):
    mp = pytest.MonkeyPatch()
    for k, v in s3server.FAKE_ENV.items():
        mp.setenv(k, v)
    server = s3server.S3Server().start()
    yield server
    server.stop()
    mp.undo()


def _store(s3, **kw) -> CheckpointStore:
    return CheckpointStore(f"s3://{s3.bucket}/{uuid.uuid4().hex[:10]}", storage_options={"endpoint_url": s3.endpoint},
                           **kw)


def test_s3_round_trip_retention_and_skipping_a_damaged_checkpoint(s3):
    store = _store(s3, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, torch_state(steps=step))
    prefix = store.loc.root.split("/", 1)[1]
    keys = s3.keys(prefix)
    assert not any("step-00000001" in k for k in keys)
    assert f"{prefix}/checkpoints/step-00000003/manifest.json" in keys
    s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/checkpoints/step-00000003/model.safetensors",
                           Body=b"garbage")
    store.loc.fs.invalidate_cache()
    ref = store.latest_good()
    assert ref.step == 2 and ref.url.startswith("s3://")
    fresh = torch_state(seed=1, steps=0)
    load(store, ref, fresh)
    assert state_of(fresh) == state_of(torch_state(steps=2))


def test_s3_lease_refuses_a_second_writer(s3):
    a = _store(s3, writer_id="a")
    a.acquire_lease()
    b = CheckpointStore(a.url, storage_options={"endpoint_url": s3.endpoint}, writer_id="b")
    with pytest.raises(Exception, match="leased to writer a"):
        b.acquire_lease()
    a.release_lease()
    b.acquire_lease()
