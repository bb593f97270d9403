"""async_saver.py: the same bytes as a synchronous save, a snapshot taken at the step boundary,
staging buffers reused across saves, one save in flight, background failures raised later,
and the "auto" checkpoint interval of CheckpointClock."""

from __future__ import annotations

import math
import threading

import psutil
import pytest
import torch

from harness import exit_codes
from harness.checkpoint import CheckpointError, CheckpointStore, capture
from harness.checkpoint.save.async_saver import AsyncSaver, BackgroundSaveError, SaveStalled, StagingBuffers
from harness.checkpoint.save.commit import Committer
from harness.config import load_config
from harness.run.cadence import CheckpointClock
from harness.run.trainer import Trainer
from harness.storage.retry import StorageUnavailable

from ..conftest import torch_state

TINY = "tests/data/tiny.toml"
ARMS = ["adamw", "muon", "lion", "olion", "adafactor", "sgdm"]


def hashes(store: CheckpointStore, step: int) -> dict[str, tuple[int, str]]:
    return {r.name: (r.size, r.digest) for r in store.manifest(store.ref(step)).files}


@pytest.mark.parametrize("arm", ARMS)
def test_async_and_sync_saves_of_one_state_have_the_same_manifest_hashes(tmp_path, arm):
    """The whole trainer state (model, optimizer arm, scheduler, data cursor, RNG, scaler, counters)
    after two steps; the async snapshot is persisted only after the next step has already changed
    every parameter and optimizer tensor in place, so equal hashes also prove it was taken at the
    step boundary."""
    cfg = load_config(TINY, [f"optim.type={arm}", f"run_dir={str(tmp_path)!r}"])
    trainer = Trainer(cfg)
    try:
        trainer.train_step()
        trainer.train_step()
        sync, background = CheckpointStore(str(tmp_path / "sync")), CheckpointStore(str(tmp_path / "async"))
        meta = {"config": {"arm": arm}}
        sync.save(trainer.step, trainer.state.parts(), meta=meta, per_rank=trainer.state.per_rank)
        gate = threading.Event()
        saver = AsyncSaver(Committer(background), per_rank=trainer.state.per_rank)
        real_commit = background.commit
        background.commit = lambda *a, **k: (gate.wait(30), real_commit(*a, **k))[1]
        saver.save(trainer.step, trainer.state.parts(), meta=meta)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step()  # mutates parameters and optimizer state in place while the save is pending
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        gate.set()
        saver.finish()
        assert hashes(background, 2) == hashes(sync, 2)
        assert set(hashes(sync, 2)) >= {"model.safetensors", "optim.safetensors", "rank-00000.safetensors",
                                        "state.json"}
    finally:
        trainer.close()


def test_staging_buffers_are_reused_and_memory_does_not_grow_over_20_saves(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = CheckpointStore(str(tmp_path / "run"), keep_last=2)
    saver = AsyncSaver(Committer(store))
    proc = psutil.Process()

    def step_and_save(step: int) -> None:
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        saver.save(step, {"model": model, "optim": opt})
        saver.finish()

    step_and_save(1)
    ptr, state_bytes = saver.ring.address, saver.ring.nbytes
    assert state_bytes > 6 << 20  # two 1 MiB weights, their AdamW moments, biases, step counters
    for step in (2, 3):
        step_and_save(step)
    rss = proc.memory_info().rss
    for step in range(4, 21):
        step_and_save(step)
    assert (saver.ring.address, saver.ring.nbytes) == (ptr, state_bytes)
    # A copy of the state per save would add 17 x state_bytes; allocator noise stays within two.
    assert proc.memory_info().rss - rss < 2 * state_bytes
    assert [r.step for r in store.list()] == [19, 20]


def test_the_buffers_are_one_block_made_anew_only_when_a_shape_or_dtype_changes():
    """The sharded parts' buffers: views of one block of their size (each pinned apart by torch's
    allocator took a power of two and a cudaHostAlloc at a save), kept while the tensors keep their
    names, shapes and dtypes, made anew on a change, the old block given back, a gone tensor's
    buffer dropped."""
    buffers = StagingBuffers()
    a, b = torch.ones(3), torch.zeros(2, 2)
    staged, events = buffers.stage(capture({"model": {"a": a, "b": b}}).tensors)
    assert events == []
    first = buffers.buffer("model.safetensors", "a").data_ptr()
    assert buffers.buffer("model.safetensors", "b").data_ptr() == first + StagingBuffers.ALIGN
    assert torch.equal(staged["model.safetensors"]["a"], a)
    a.add_(1)  # the staged copy is detached from the live tensor
    assert torch.equal(staged["model.safetensors"]["a"], torch.ones(3))
    buffers.stage(capture({"model": {"a": a, "b": b}}).tensors)
    assert buffers.buffer("model.safetensors", "a").data_ptr() == first
    old = buffers._block
    staged, _ = buffers.stage(capture({"model": {"a": a, "b": b.double()}}).tensors)
    assert buffers.buffer("model.safetensors", "b").dtype == torch.float64 and old.tensor is None  # given back
    assert torch.equal(staged["model.safetensors"]["a"], a) and buffers._block.nbytes == 2 * StagingBuffers.ALIGN
    buffers.stage(capture({"model": {"a": a}}).tensors)
    with pytest.raises(KeyError):
        buffers.buffer("model.safetensors", "b")


class Gated:
    """Wraps a store's commit so a test decides when a persist may proceed (or fails it)."""

    def __init__(self, store: CheckpointStore, error: BaseException | None = None) -> None:
        self.gate, self.error, self.real = threading.Event(), error, store.commit
        store.commit = self.commit

    def commit(self, *args, **kwargs):
        self.gate.wait(30)
        if self.error is not None:
            raise self.error
        return self.real(*args, **kwargs)


def test_one_save_in_flight_skip_or_wait(run_dir):
    parts = torch_state(steps=1)
    store = CheckpointStore(run_dir)
    gated = Gated(store)
    skipper = AsyncSaver(Committer(store), when_busy="skip")
    assert skipper.save(1, parts) is not None
    assert skipper.busy
    assert skipper.save(2, parts) is None  # skipped: the buffers still belong to step 1
    threading.Timer(0.3, gated.gate.set).start()
    forced = skipper.save(3, parts, must=True)  # the final/preemption save waits instead
    assert forced.waited_s >= 0.2 and forced.blocking_s >= forced.waited_s
    skipper.finish()
    assert [r.step for r in store.list()] == [1, 3]

    gated.gate.clear()
    waiter = AsyncSaver(Committer(store), when_busy="wait")
    waiter.save(4, parts)
    threading.Timer(0.3, gated.gate.set).start()
    assert waiter.save(5, parts).waited_s >= 0.2
    waiter.finish()
    assert [r.step for r in store.list()][-2:] == [4, 5]


@pytest.mark.parametrize("error, raised", [(OSError("disk on fire"), BackgroundSaveError),
                                           (CheckpointError("lost the lease"), CheckpointError),
                                           (StorageUnavailable("storage endpoint http://s3 unavailable"),
                                            StorageUnavailable)])
def test_a_background_failure_is_raised_at_the_next_call_naming_the_step(run_dir, error, raised):
    parts = torch_state(steps=1)
    store = CheckpointStore(run_dir)
    gated = Gated(store, error)
    saver = AsyncSaver(Committer(store))
    saver.save(7, parts)
    saver.poll()  # still running: nothing to raise yet
    gated.gate.set()
    saver.wait()
    with pytest.raises(raised, match="step 7") as info:
        saver.poll()
    assert info.value.__cause__ is error
    saver.poll()  # raised once, not again

    gated.gate.clear()
    saver.save(8, parts)
    gated.gate.set()
    with pytest.raises(raised, match="step 8"):
        saver.finish()  # at exit and on preemption: waits, then raises
    assert store.list() == []


def test_a_stalled_save_is_reported_while_slow_and_given_up_at_the_deadline_naming_the_step(run_dir):
    store = CheckpointStore(run_dir)
    gated = Gated(store)  # a persist that never gets an answer from its storage
    slow = []
    saver = AsyncSaver(Committer(store), save_deadline_s=1.0, slow_floor_s=0.1,
                       on_slow=lambda step, s: slow.append(step))
    saver.save(7, torch_state(steps=1))
    stalled = r"step 7 has not committed after \d+s \(checkpoint.save_deadline_s = 1\)"
    with pytest.raises(SaveStalled, match=stalled) as info:
        saver.save(8, torch_state(steps=1))  # the wait for the previous save is bounded
    assert info.value.exit_code == exit_codes.STORAGE_UNAVAILABLE
    assert slow and set(slow) == {7}
    with pytest.raises(SaveStalled, match="step 7"):
        saver.poll()  # the step loop sees it too, between steps
    gated.gate.set()  # the storage answers after all: the commit is atomic either way
    saver.wait()
    saver.poll()
    assert [r.step for r in store.list()] == [7]


def test_a_slow_save_that_commits_is_reported_and_not_an_error(run_dir):
    store = CheckpointStore(run_dir)
    gated = Gated(store)
    slow = []
    saver = AsyncSaver(Committer(store), save_deadline_s=600, slow_floor_s=0.05,
                       on_slow=lambda step, s: (slow.append(step), gated.gate.set()))
    saver.save(3, torch_state(steps=1))
    saver.finish()
    assert set(slow) == {3} and [r.step for r in store.list()] == [3]


def test_a_failure_is_raised_by_the_next_save_and_logged_by_close(run_dir):
    parts = torch_state(steps=1)
    store = CheckpointStore(run_dir)
    gated = Gated(store, OSError("no space left"))
    gated.gate.set()
    saver = AsyncSaver(Committer(store))
    saver.save(1, parts)
    saver.wait()
    with pytest.raises(BackgroundSaveError, match="step 1.*no space left"):
        saver.save(2, parts)
    saver.save(3, parts)
    saver.close()  # logs the failure of step 3 instead of masking an error already propagating
    saver.poll()


def test_auto_interval_is_young_daly_from_the_measured_save_and_step_times():
    reports = []
    clock = CheckpointClock("auto", 0.0, 10_000, mtbf_s=3600.0, report=reports.append, clock=lambda: 0.0)
    assert clock.due(1)  # the measuring save, right after the first step
    clock.saved(1, blocking_s=0.5)
    for _ in range(5):
        assert not clock.due(2)
        clock.observe_step(0.2)
    assert reports == []  # the first save is not committed yet: its persist time is an input
    clock.committed(2.0)
    clock.observe_step(0.2)
    expected_s = math.sqrt(2 * 0.5 * 3600.0)  # 60 s
    assert clock.every_steps == math.ceil(expected_s / 0.2) == 300
    (report,) = reports
    assert report["every_steps"] == 300 and report["blocking_s"] == 0.5 and report["mtbf_s"] == 3600.0
    assert report["step_s"] == pytest.approx(0.2) and report["interval_s"] == pytest.approx(expected_s)
    assert not clock.due(300) and clock.due(301)
    clock.saved(301, blocking_s=9.0)
    assert not clock.due(600) and clock.due(601) and clock.due(10_000)
    clock.observe_step(5.0)
    assert len(reports) == 1  # chosen once per process


def test_auto_interval_never_shorter_than_the_persist():
    clock = CheckpointClock("auto", 0.0, 10_000, mtbf_s=1.0)
    clock.saved(1, blocking_s=0.01)
    clock.committed(3.0)
    for _ in range(3):
        clock.observe_step(0.5)
    assert clock.every_steps == 6  # sqrt(2 * 0.01 * 1) = 0.14 s, but the persist takes 3 s


def test_one_clock_per_tier_each_from_its_own_save_cost():
    """The persistent and the local tier's "auto" clocks see the same steps and MTBF but their own
    saves: a local save 100x cheaper (synchronous: committed when it returns) gives a 10x shorter
    interval, and neither save moves the other clock."""
    persistent = CheckpointClock("auto", 0.0, 10_000, mtbf_s=3600.0, clock=lambda: 0.0)
    local = CheckpointClock("auto", 0.0, 10_000, mtbf_s=3600.0, clock=lambda: 0.0)
    persistent.saved(1, blocking_s=2.0)
    persistent.committed(2.0)
    assert local.due(2)  # the local tier's own measuring save
    local.saved(2, blocking_s=0.02)
    local.committed(0.02)
    for _ in range(3):
        persistent.observe_step(0.1)
        local.observe_step(0.1)
    assert (persistent.every_steps, local.every_steps) == (1200, 120)  # sqrt(2 * 2 * 3600) = 120 s; 12 s
    assert not persistent.due(1200) and persistent.due(1201) and not local.due(121) and local.due(122)


def test_the_measuring_save_stays_due_until_a_save_measured_its_cost():
    """A rollback (or a skipped save) resets the count without a blocking time: "auto" must still
    take its measuring save, or it would never choose an interval."""
    clock = CheckpointClock("auto", 0.0, 10_000, mtbf_s=3600.0, clock=lambda: 0.0)
    clock.saved(3)
    assert clock.due(4)
    clock.saved(4, blocking_s=0.5)
    assert not clock.due(5)


def test_fixed_interval_is_unchanged():
    clock = CheckpointClock(4, 0.0, 10)
    assert [s for s in range(1, 11) if clock.due(s)] == [4, 8, 10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_state_is_staged_in_pinned_buffers_on_a_side_stream(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    opt.step()
    sync, background = CheckpointStore(str(tmp_path / "sync")), CheckpointStore(str(tmp_path / "async"))
    sync.save(1, {"model": model, "optim": opt})
    gated = Gated(background)
    saver = AsyncSaver(Committer(background))
    saver.save(1, {"model": model, "optim": opt})
    with torch.no_grad():
        model.weight.add_(1.0)  # queued on the training stream after the copies: must not leak into the save
    gated.gate.set()
    saver.finish()
    assert saver.ring.pinned  # the tensor files stream through pinned memory
    assert hashes(background, 1) == hashes(sync, 1)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_full_disk_in_the_background_is_a_user_error_naming_what_is_still_committed(tmp_path, where):
    """Injected ENOSPC at every write of a background save (the real full disk: tests/e2e/test_full_disk_train.py)."""
    url = str(tmp_path / "run") if where == "local" else f"memory://async-enospc-{tmp_path.name}"
    parts = torch_state(steps=1)
    count = CheckpointStore(url + "-count", storage_options={"faults": "count"})
    count.save(1, parts)
    writes = [n for n, op, _ in count.loc.fs.injector.trace if op in ("write", "put")]
    for at in writes[:: max(1, len(writes) // 4)]:
        for previous in (None, 3):
            run = f"{url}-{at}-{previous}"
            if previous is not None:
                CheckpointStore(run).save(previous, parts)
            saver = AsyncSaver(Committer(CheckpointStore(run, storage_options={"faults": f"enospc@{at}"})),
                               last_committed=previous)
            saver.save(5, parts)
            with pytest.raises(CheckpointError, match="step 5 could not be written to .*ENOSPC") as info:
                saver.finish()
            if previous is None:
                assert "no earlier checkpoint of this run exists" in str(info.value)
            else:
                assert "the checkpoint at step 3 is still the newest good one" in str(info.value)
