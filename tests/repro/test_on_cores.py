"""on_cores.py: a pass over a large state runs on a thread per core, in order, with the same
results as on one thread (the fingerprints' state hash, the finite-state check of a save), and a
small one or a GPU's stays on the calling thread."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.config import load_config
from harness.repro import on_cores as on_cores_module
from harness.repro.fingerprint import state_digests
from harness.repro.on_cores import MIN_BYTES, host_bytes, on_cores
from harness.run.trainer import Trainer, TrainingDiverged
from procs import TINY


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(on_cores_module, "cores", lambda: 2)


def test_a_large_pass_runs_on_a_thread_per_core_in_order(two_cores):
    both = threading.Barrier(2, timeout=10)  # passes only when two items run at once

    def square(x: int) -> int:
        if x < 2:
            both.wait()
        return x * x

    assert on_cores(square, [0, 1, 2, 3], MIN_BYTES) == [0, 1, 4, 9]


def test_a_small_pass_stays_on_the_calling_thread(two_cores):
    caller = threading.get_ident()
    assert on_cores(lambda _: threading.get_ident(), [0, 1, 2], MIN_BYTES - 1) == [caller] * 3


def test_an_error_of_the_pass_is_raised_to_the_caller(two_cores):
    def fail(x: int) -> int:
        if x == 3:
            raise ValueError("item 3")
        return x

    with pytest.raises(ValueError, match="item 3"):
        on_cores(fail, list(range(8)), MIN_BYTES)


def test_host_bytes_counts_host_tensors_and_keeps_a_gpus_on_the_calling_thread():
    assert host_bytes([torch.zeros(4), torch.zeros(2, dtype=torch.float64)]) == 32
    assert host_bytes([torch.zeros(4), torch.zeros(1, device="meta")]) == 0


def test_the_state_hash_is_the_same_on_every_core_as_on_one(two_cores, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    serial = state_digests({"model": model, "optim": opt})
    monkeypatch.setattr(on_cores_module, "MIN_BYTES", 0)  # the threaded pass for this small state
    assert state_digests({"model": model, "optim": opt}) == serial


def test_the_finite_state_check_on_every_core_names_the_poisoned_tensor(two_cores, monkeypatch, tmp_path):
    monkeypatch.setattr(on_cores_module, "MIN_BYTES", 0)
    trainer = Trainer(load_config(TINY, [f"run_dir={str(tmp_path)!r}"]))
    trainer.train_step()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a training step on one thread
    threads = set()
    summed = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, **kw: threads.add(threading.get_ident()) or summed(t, **kw))
    trainer.check_finite_state()  # a finite state passes
    assert threads and threading.get_ident() not in threads  # summed on the pass's threads
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[3] = float("inf")
    with pytest.raises(TrainingDiverged, match=f"model/{name} holds NaN/inf after step 1"):
        trainer.check_finite_state()
    trainer.close()


def test_calls_that_use_threads_of_their_own_share_the_cores_out(two_cores):
    caller = threading.get_ident()
    assert on_cores(lambda _: threading.get_ident(), [0, 1, 2], MIN_BYTES, each_uses=2) == [caller] * 3
