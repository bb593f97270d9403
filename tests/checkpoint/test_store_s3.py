"""CheckpointStore on s3:// through the fault proxy: with a quarter of the requests faulted, saves
commit, every committed checkpoint verifies, loading is bitwise, no multipart upload is left open,
a prefix without a manifest is ignored, and the fake secret appears in no object and no log line."""

from __future__ import annotations

import subprocess

import torch
from torch import nn

from harness.checkpoint import CheckpointStore, load
from procs import ENV, finished, popen
from s3proxy import FaultPlan
from s3server import FAKE_ENV, FAKE_KEY, FAKE_SECRET, options


def parts(seed: int) -> dict:
    """A model big enough for multipart uploads (6 MiB of weights > the 5 MiB block) and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1536), nn.Tanh(), nn.Linear(1536, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt}


def train(p: dict, steps: int) -> None:
    for _ in range(steps):
        p["optim"].zero_grad()
        p["model"](torch.randn(4, 1024)).square().mean().backward()
        p["optim"].step()


def tensors(p: dict) -> list[torch.Tensor]:
    return [*p["model"].state_dict().values(),
            *(t for s in p["optim"].state_dict()["state"].values() for t in s.values())]


def test_store_round_trip_under_faults(proxy, s3_server, s3_url, capfd, caplog):
    proxy.plan = FaultPlan(rate=0.25, seed=11)
    store = CheckpointStore(s3_url, keep_last=2, storage_options=options(proxy.endpoint, default_block_size=5 << 20))
    live = parts(seed=0)
    for step in (1, 2, 3):
        train(live, 1)
        store.save(step, live, meta={"step": step})
    assert sum(proxy.faults.values()) >= 10, proxy.faults

    committed = store.list()
    assert [r.step for r in committed] == [2, 3]
    assert all(store.verify(ref) == [] for ref in committed)
    assert store.latest_good().step == 3
    fresh = parts(seed=1)
    train(fresh, 1)
    assert load(store, store.latest_good(), fresh) == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(tensors(live), tensors(fresh), strict=True))
    assert s3_server.open_multipart_uploads() == []

    out, err = capfd.readouterr()
    logs = out + err + caplog.text
    assert "storage retry" in logs  # the faults were logged, so this check looked at real output
    objects = [s3_server.client().get_object(Bucket=s3_server.bucket, Key=k)["Body"].read()
               for k in s3_server.keys(s3_url.split("/", 3)[3])]
    for secret in (FAKE_SECRET, FAKE_KEY):
        assert secret not in logs
        assert not any(secret.encode() in body for body in objects)


def test_prefix_without_manifest_is_ignored(proxy, s3_server, s3_url):
    store = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    live = parts(seed=0)
    store.save(1, live)
    train(live, 1)
    store.save(2, live)
    prefix = s3_url.split("/", 3)[3]
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/checkpoints/step-00000002/manifest.json")
    reopened = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    assert [r.step for r in reopened.list()] == [1]
    assert reopened.latest_good().step == 1


def test_deleting_what_is_partly_or_wholly_gone_is_no_error(proxy, s3_server, s3_url):
    """`delete` removes without checking first (every check is a request): a checkpoint whose
    manifest a crashed deleter already removed, and one removed twice, are no error; the
    others stay."""
    store = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    live = parts(seed=0)
    for step in (1, 2, 3):
        store.save(step, live)
    before = [r.step for r in store.list()]
    assert 2 in before
    prefix = s3_url.split("/", 3)[3]
    s3_server.client().delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/checkpoints/step-00000002/manifest.json")
    store.delete(store.ref(2))
    store.delete(store.ref(2))
    committed, incomplete = store.scan()
    assert [r.step for r in committed] == [s for s in before if s != 2] and not incomplete
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/checkpoints/step-00000002/")
    assert not listed.get("Contents")


def test_discovery_sees_what_another_process_wrote(proxy, s3_url):
    """One process's view of the run dir follows another writer's commits and deletions (the
    supervisor polls the newest checkpoint while its child trains), despite s3fs's listing cache."""
    reader = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    writer = CheckpointStore(s3_url, storage_options=options(proxy.endpoint, skip_instance_cache=True))
    assert reader.loc.fs is not writer.loc.fs
    live = parts(seed=0)
    writer.save(1, live)
    assert reader.latest_good().step == reader.latest_committed().step == 1
    writer.save(2, live)
    assert reader.latest_committed().step == reader.latest_good().step == 2
    writer.delete(writer.ref(2))
    assert [r.step for r in reader.list()] == [1] and reader.latest_committed().step == 1


def test_uploads_left_open_by_a_killed_writer_are_aborted_by_the_next(proxy, s3_server, s3_url):
    """A writer killed mid-upload leaves an open multipart upload (billed until aborted); the
    next writer aborts it when it takes the lease. Uploads outside the run dir are not touched."""
    client = s3_server.client()
    prefix = s3_url.split("/", 3)[3]
    left = []
    for key in (f"{prefix}/checkpoints/step-00000003/model.safetensors", f"{prefix}-other/x"):
        upload = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=s3_server.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
        left.append(key)
    store = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    store.acquire_lease()
    try:
        assert [u["Key"] for u in s3_server.open_multipart_uploads()] == [left[1]]
    finally:
        store.release_lease()
        client.abort_multipart_upload(Bucket=s3_server.bucket, Key=left[1],
                                      UploadId=s3_server.open_multipart_uploads()[0]["UploadId"])


def test_no_permission_to_list_uploads_does_not_stop_the_writer(proxy, s3_url):
    store = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    real = store.loc.fs.call_s3

    def call_s3(method, *args, **kwargs):
        if method == "list_multipart_uploads":
            proxy.script = ["forbidden403"]
        return real(method, *args, **kwargs)

    store.loc.fs.call_s3 = call_s3
    try:
        store.acquire_lease()
        assert store._lease.held and proxy.faults["forbidden403"] == 1
    finally:
        del store.loc.fs.call_s3
        store.release_lease()


def test_ckpt_commands_take_storage_options(s3_server, s3_url):
    """`harness ckpt` reaches an S3-compatible endpoint given only by `-o endpoint_url=...`."""
    store = CheckpointStore(s3_url, storage_options={"endpoint_url": s3_server.endpoint})
    live = parts(seed=0)
    store.save(1, live)
    store.save(2, live)
    opts = ["-o", f"endpoint_url={s3_server.endpoint}", "-o", "retry.attempts=2"]

    def ckpt(*args: str) -> subprocess.CompletedProcess:
        return finished(popen(["ckpt", *args, *opts], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**ENV, **FAKE_ENV}), timeout=120)

    ls = ckpt("ls", s3_url)
    assert ls.returncode == 0 and "step" in ls.stdout, ls.stderr
    assert ckpt("verify", s3_url).returncode == 0
    diff = ckpt("diff", f"{s3_url}/checkpoints/step-00000001", f"{s3_url}/checkpoints/step-00000002")
    assert diff.returncode == 0 and "bitwise equal" in diff.stdout, diff.stdout + diff.stderr
    bad = ckpt("ls", s3_url, "-o", "retry")
    assert bad.returncode == 2 and "-o 'retry': expected key=value" in bad.stderr


def test_starting_a_commit_asks_the_store_once_and_a_recommit_replaces_the_manifest(proxy, s3_server, s3_url):
    """`begin` on an object store removes the step's manifest without asking first whether the
    bucket or the manifest exists (each question was a request, at every save); committing a
    step again replaces the checkpoint, and until its new manifest is written, none is listed."""
    store = CheckpointStore(s3_url, storage_options=options(proxy.endpoint))
    store.save(1, parts(seed=0))
    proxy.reset_counters()
    ref, work = store.begin(2)
    assert proxy.total() == 1 and work == ref.path
    ref, _ = store.begin(1)  # the committed step 1 loses its manifest first
    assert [r.step for r in store.list()] == []
    again = parts(seed=1)
    store.save(1, again)
    restored = parts(seed=2)
    load(store, store.ref(1), restored)
    assert all(torch.equal(a, b) for a, b in zip(tensors(again), tensors(restored), strict=True))


def test_finding_verifying_and_loading_read_each_object_once_without_asking_about_it(proxy, s3_server, s3_url):
    """What a save's retention, the progress probe, a verification and a load need to know of a
    checkpoint's objects (present? how large?) comes from listings: no HEAD request at all
    (three per file before), and each file of the checkpoint is fetched once per reader."""
    store = CheckpointStore(s3_url, keep_last=2, storage_options=options(proxy.endpoint))
    live = parts(seed=0)
    train(live, 1)
    for step in (1, 2, 3):
        store.save(step, live)
    prefix = s3_url.split("/", 3)[3]
    files = sorted(k.rsplit("/", 1)[1] for k in s3_server.keys(f"{prefix}/checkpoints/step-00000003/"))
    assert files == ["manifest.json", "model.safetensors", "optim.safetensors", "state.json"]

    def fetched() -> dict[str, int]:
        gets = {path.split("?")[0].rsplit("/", 1)[1]: n for (method, path), n in proxy.seen.items()
                if method == "GET" and "step-00000004/" in path}
        proxy.reset_counters()
        return gets

    proxy.reset_counters()
    store.save(4, live)  # retention removes step 2
    assert proxy.total("HEAD") == 0 and [r.step for r in store.list()] == [3, 4]
    proxy.reset_counters()
    assert store.latest_committed().step == 4
    assert proxy.total("HEAD") == 0 and fetched() == {"manifest.json": 1}
    assert store.latest_good().step == 4
    assert proxy.total("HEAD") == 0 and fetched() == dict.fromkeys(files, 1)
    load(store, store.ref(4), parts(seed=1))
    assert proxy.total("HEAD") == 0 and fetched() == dict.fromkeys(files, 1)
