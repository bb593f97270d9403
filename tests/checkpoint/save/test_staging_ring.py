"""staging_ring.py through the background saver: with a ring smaller than the state the files are
the same bytes as a synchronous save, the snapshot is still the state at the step boundary, the
memory a save holds is the ring, a writer that fails or hangs is reported instead of waited for
forever, and `prepare` allocates the ring before the first save. Unset, the ring stops at the
host's budget; on a GPU it is pinned at its exact size, a grown one gives its old block back, and
the writer waits for a piece's copy asleep (CUDA's registration and events faked: helpers.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from harness.checkpoint import CheckpointStore
from harness.checkpoint.host_memory import copies_done
from harness.checkpoint.save import staging_ring
from harness.checkpoint.save.async_saver import AsyncSaver, BackgroundSaveError, SaveStalled
from harness.checkpoint.save.commit import Committer
from harness.checkpoint.save.staging_ring import MIN_CAPACITY, StagingRing
from harness.repro import on_cores as on_cores_module
from helpers import FakeCudaEvent, Registrations
from procs import TINY, assert_one_line_error, assert_same_run, harness

CAP = MIN_CAPACITY  # 64 MiB


def big_state() -> dict[str, dict[str, torch.Tensor]]:
    """Almost two rings of tensors (three of 40 MiB in two files, some small ones, an empty one)."""
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(10 << 20, generator=g) for i in range(2)}
    optim = {"m": torch.randn(10 << 20, generator=g), "step": torch.tensor(3), "none": torch.empty(0),
             "half": torch.randn(1000, generator=g).half()}
    return {"model": weights, "optim": optim}


def hashes(store: CheckpointStore, step: int) -> dict[str, tuple[int, str]]:
    return {r.name: (r.size, r.digest) for r in store.manifest(store.ref(step)).files}


def test_a_ring_smaller_than_the_state_writes_the_same_bytes_and_holds_only_the_ring(tmp_path):
    state = big_state()
    sync = CheckpointStore(str(tmp_path / "sync"))
    sync.save(1, state)
    store = CheckpointStore(str(tmp_path / "ring"))
    saver = AsyncSaver(Committer(store), staging_bytes=CAP, persist_delay_s=0.2)  # the writer starts late
    submitted = saver.save(1, state)
    for named in state.values():  # the step after the boundary changes every tensor in place
        for t in named.values():
            t.add_(1)
    saver.finish()
    assert hashes(store, 1) == hashes(sync, 1)
    assert saver.ring.nbytes == CAP < submitted.nbytes


def test_a_ring_that_holds_the_state_is_filled_on_every_core_with_the_same_bytes(tmp_path, monkeypatch):
    """The whole-ring copy (more than on_cores.MIN_BYTES: a thread per core) writes what a
    synchronous save writes, and the snapshot is the state at the boundary."""
    monkeypatch.setattr(on_cores_module, "cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the training step's threads: one
    threads = set()
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src: threads.add(threading.get_ident()) or copy(t, src))
    state = big_state()
    sync = CheckpointStore(str(tmp_path / "sync"))
    sync.save(1, state)
    store = CheckpointStore(str(tmp_path / "ring"))
    saver = AsyncSaver(Committer(store), persist_delay_s=0.2)
    submitted = saver.save(1, state)
    monkeypatch.undo()
    for named in state.values():
        for t in named.values():
            t.add_(1)
    saver.finish()
    assert hashes(store, 1) == hashes(sync, 1)
    assert saver.ring.nbytes == submitted.nbytes and len(threads) == 2


def test_the_ring_is_reused_by_the_next_save(tmp_path):
    state = big_state()
    store = CheckpointStore(str(tmp_path / "run"), keep_last=3)
    saver = AsyncSaver(Committer(store), staging_bytes=CAP)
    saver.save(1, state)
    saver.finish()
    address = saver.ring.address
    state["model"]["w0"].mul_(2)
    saver.save(2, state)
    saver.finish()
    assert saver.ring.address == address
    sync = CheckpointStore(str(tmp_path / "sync"))
    sync.save(2, state)
    assert hashes(store, 2) == hashes(sync, 2)


def test_prepare_allocates_the_ring_before_the_first_save(tmp_path):
    state = big_state()
    saver = AsyncSaver(Committer(CheckpointStore(str(tmp_path / "run"))))
    saver.prepare(state)
    address = saver.ring.address
    nbytes = sum(t.numel() * t.element_size() for named in state.values() for t in named.values())
    assert address is not None and saver.ring.nbytes == nbytes
    saver.save(1, state)
    saver.finish()
    assert saver.ring.address == address


class FailingStore(CheckpointStore):
    """A store whose writes fail after the first chunk of a file, or block until released."""

    def __init__(self, url: str, *, fail: bool) -> None:
        super().__init__(url)
        self.fail, self.release = fail, threading.Event()

    def write_file(self, work, ref, name, chunks):
        def first_then(chunks):
            for chunk in chunks:
                yield chunk
                if self.fail:
                    raise OSError("disk on fire")
                self.release.wait(30)
        return super().write_file(work, ref, name, first_then(chunks))


def test_a_writer_that_fails_while_the_step_loop_waits_for_room_is_raised_not_waited_for(tmp_path):
    store = FailingStore(str(tmp_path / "run"), fail=True)
    saver = AsyncSaver(Committer(store), staging_bytes=CAP)
    with pytest.raises(BackgroundSaveError, match="step 1 failed: disk on fire"):
        saver.save(1, big_state())
    assert store.list() == []
    store.fail = False
    store.release.set()
    saver.save(2, big_state())  # the ring is usable again
    saver.finish()
    assert [r.step for r in store.list()] == [2]


def test_a_writer_that_hangs_while_the_step_loop_waits_for_room_is_given_up_at_the_deadline(tmp_path):
    store = FailingStore(str(tmp_path / "run"), fail=False)
    saver = AsyncSaver(Committer(store), staging_bytes=CAP, save_deadline_s=1.0, slow_floor_s=0.2)
    with pytest.raises(SaveStalled, match="step 1 has not committed"):
        saver.save(1, big_state())
    store.release.set()  # the storage answers after all: the staging stopped, nothing is committed
    saver.wait()
    with pytest.raises(BackgroundSaveError, match="staging stopped"):
        saver.poll()
    assert store.list() == []


def test_a_capacity_under_the_minimum_is_refused():
    with pytest.raises(ValueError, match="under the minimum"):
        StagingRing(MIN_CAPACITY - 1)


def test_harness_train_with_a_ring_under_the_state_ends_bitwise_as_without(tmp_path):
    """`checkpoint.staging_mib = 64` on a run with about 150 MiB of state (a 512-wide GPT and its
    AdamW moments), saved in the background every 2 steps: the same checkpoints and losses as the
    default staging; an under-minimum size is a one-line error."""
    wide = ["--set", "model.args.d_model=512", "--set", "model.args.n_layer=4", "--set", "optim.type='adamw'",
            "--set", "train.steps=4", "--set", "checkpoint.every_steps=2"]
    runs = {name: tmp_path / name for name in ("ring", "whole")}
    harness("train", str(TINY), "--run-dir", str(runs["ring"]), *wide, "--set", "checkpoint.staging_mib=64",
            check=True)
    harness("train", str(TINY), "--run-dir", str(runs["whole"]), *wide, check=True)
    assert_same_run(runs["ring"], runs["whole"], 4)
    small = harness("train", str(TINY), "--run-dir", str(tmp_path / "small"), "--set", "checkpoint.staging_mib=8")
    assert_one_line_error(small, "checkpoint.staging_mib")
    assert not (tmp_path / "small").exists()


def test_the_step_loop_prepares_the_ring_after_a_fresh_first_step_and_before_a_resumed_one(tmp_path, monkeypatch):
    """In a real training process (in this one): the staging ring is allocated once the state is
    whole, after step 1 of a fresh run (AdamW makes its moments there) and before the first step
    of a resumed one, so neither's first save waits for it."""
    from harness.config import load_config
    from harness.run import session

    prepared: list[int] = []
    real = AsyncSaver.prepare
    monkeypatch.setattr(AsyncSaver, "prepare",
                        lambda self, parts: prepared.append(parts["trainer"].step) or real(self, parts))
    run = f"run_dir={str(tmp_path / 'run')!r}"
    assert session.train(load_config(TINY, [run, "train.steps=4", "debug.step_sleep_s=0"])) == 0
    assert prepared == [1]
    assert session.train(load_config(TINY, [run, "train.steps=6", "debug.step_sleep_s=0"]),
                         allow_config_change=True) == 0
    assert prepared == [1, 4]


def test_with_a_local_tier_the_ring_is_prepared_for_the_local_tiers_snapshot(tmp_path, monkeypatch):
    """The two tiers share one ring; a local save stages a rank's whole state where the run dir's
    save stages (past rank 0) its per-rank parts only, so the ring is prepared through the local
    tier, once: a rank > 0 would otherwise allocate it whole at its first local save, in the step."""
    from harness.checkpoint.save.local_tier import LocalTier
    from harness.config import load_config
    from harness.run import session

    local: list[int] = []
    real = LocalTier.prepare
    monkeypatch.setattr(LocalTier, "prepare",
                        lambda self, parts: local.append(parts["trainer"].step) or real(self, parts))
    run = [f"run_dir={str(tmp_path / 'run')!r}", f"checkpoint.local.dir={str(tmp_path / 'local')!r}",
           "checkpoint.local.every_steps=2", "train.steps=4", "debug.step_sleep_s=0"]
    assert session.train(load_config(TINY, run)) == 0
    assert local == [1]


def test_an_unset_ring_grows_to_the_state_up_to_the_hosts_budget(tmp_path, monkeypatch):
    """Pinned whole, 8 ranks' states of tens of GB took the host's memory: unset, the ring is at
    most half the memory available, shared by the node's ranks, and a save beyond it streams the
    same bytes."""
    monkeypatch.setattr(staging_ring.psutil, "virtual_memory", lambda: SimpleNamespace(available=8 << 30))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert staging_ring.default_host_budget() == 1 << 30
    monkeypatch.setattr(staging_ring, "default_host_budget", lambda: CAP)
    state = big_state()
    sync = CheckpointStore(str(tmp_path / "sync"))
    sync.save(1, state)
    store = CheckpointStore(str(tmp_path / "ring"))
    saver = AsyncSaver(Committer(store))
    submitted = saver.save(1, state)
    saver.finish()
    assert saver.ring.nbytes == CAP < submitted.nbytes
    assert hashes(store, 1) == hashes(sync, 1)


def test_a_gpu_states_ring_is_pinned_at_its_size_and_a_grown_one_gives_the_old_block_back(tmp_path, monkeypatch):
    """Pinned through torch's allocator a ring took the next power of two and a grown ring kept
    its old block for good. The state is on the CPU here; `on_gpu` says GPU, so the ring pins
    (faked registrations) and copies tensor by tensor, as for a GPU's."""
    cuda = Registrations(monkeypatch)
    monkeypatch.setattr(staging_ring, "on_gpu", lambda tensors: True)
    state = big_state()
    del state["optim"]["m"]
    ring = StagingRing()
    ring.prepare(state)
    first = sum(t.numel() * t.element_size() for named in state.values() for t in named.values())
    assert ring.pinned and ring.nbytes == first and cuda.registered == [(ring.address, first)]
    state["optim"]["m"] = torch.randn(3 << 20)  # the optimizer made its state: the ring grows
    ring.prepare(state)
    grown = first + (12 << 20)
    assert ring.nbytes == grown and cuda.unregistered == [cuda.registered[0][0]]
    assert cuda.registered[1] == (ring.address, grown)
    sync = CheckpointStore(str(tmp_path / "sync"))
    sync.save(1, state)
    store = CheckpointStore(str(tmp_path / "ring"))
    saver = AsyncSaver(Committer(store))
    saver.ring = saver.staging.ring = ring
    saver.save(1, state)
    saver.finish()
    assert hashes(store, 1) == hashes(sync, 1)


def test_the_writer_waits_for_a_pieces_device_copy_asleep(monkeypatch):
    """A GPU tensor's piece reaches the writer with the event its copy ends at; the writer waits
    for it without spinning a core beside the training processes (CUDA busy-waits on an event made
    without cudaEventBlockingSync: helpers.FakeCudaEvent)."""
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    ring = StagingRing()
    files = ring.begin({"model.safetensors": {"w": torch.ones(1000)}}, lambda: True)
    # What `feed` queues for a GPU tensor's piece (staging_ring._feed_tensor), with its copy's event.
    ring._pieces.put(("model.safetensors", "w", ring._generation, 0, 4000, True, copies_done(object())))
    spent = []

    def writer() -> None:
        t0, cpu0 = time.monotonic(), time.thread_time()
        pieces = list(files["model.safetensors"].chunks("w"))
        spent.append((time.monotonic() - t0, time.thread_time() - cpu0, len(pieces)))

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join(10)
    wall, cpu, pieces = spent[0]
    assert pieces == 1 and wall >= FakeCudaEvent.delay_s * 0.9
    assert cpu < wall / 4, f"the writer spent {cpu:.2f} s of CPU waiting {wall:.2f} s for a copy"
