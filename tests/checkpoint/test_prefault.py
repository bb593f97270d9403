"""prefault.py: the new tensors a load reads into are faulted in by a second thread, which never
writes a tensor the load has taken; and a load into a fresh optimizer (a resumed process's) goes
through it and is bitwise."""

from __future__ import annotations

import threading
import time

import torch

import harness.checkpoint.into_live as into_live
import harness.checkpoint.prefault as prefault
from harness.checkpoint import CheckpointStore, load
from harness.checkpoint.prefault import MIN_BYTES, Prefault

MiB = 1 << 20


def _new(n: int, nbytes: int = MiB) -> list[torch.Tensor]:
    return [torch.empty(nbytes // 4) for _ in range(n)]


def test_the_thread_faults_in_tensors_from_the_last_while_the_load_reads_from_the_first():
    tensors = _new(16)
    with Prefault(tensors) as pf:
        for i in range(len(tensors)):
            t = pf.take(i)
            assert t is tensors[i]
            t.fill_(i + 1)
            time.sleep(0.002)  # a read's pace: the thread gets ahead
    assert pf.faulted > 0 and pf.faulted % MiB == 0
    assert [t.unique().tolist() for t in tensors] == [[i + 1] for i in range(16)]


def test_a_tensor_the_load_took_is_never_written_by_the_thread(monkeypatch):
    """The thread's writes come late (after a pause): a `take` that did not wait for a tensor being
    faulted in, or a thread that faulted in a taken one, would overwrite the bytes read."""
    faulting = threading.Event()

    def slow_fault_in(t):
        faulting.set()
        time.sleep(0.02)
        t.fill_(-7.0)

    monkeypatch.setattr(prefault, "_fault_in", slow_fault_in)
    tensors = _new(8)
    with Prefault(tensors) as pf:
        faulting.wait(5)
        for i in range(len(tensors)):
            pf.take(i).fill_(i + 1)  # meets the thread's tensor mid-way, and must wait for it
    assert [t.unique().tolist() for t in tensors] == [[i + 1] for i in range(8)]
    assert 0 < pf.faulted < 8 * MiB


def test_small_tensors_are_left_to_the_load_and_need_no_thread():
    small = _new(4, MIN_BYTES // 2)
    with Prefault(small) as pf:
        assert pf._thread is None
        assert all(pf.take(i) is small[i] for i in range(4))
    assert pf.faulted == 0


def test_close_stops_the_thread_before_the_end(monkeypatch):
    monkeypatch.setattr(prefault, "_fault_in", lambda t: time.sleep(0.01))
    pf = Prefault(_new(100))
    pf.close()
    assert not pf._thread.is_alive()
    assert pf.faulted <= 2 * MiB


def test_a_fresh_optimizer_loads_bitwise_through_the_prefault(run_dir, monkeypatch):
    """A resumed process: the model exists, the optimizer has no state yet, so its moments are
    read into new tensors, which the thread faults in."""
    made: list[Prefault] = []

    class Recorded(Prefault):
        def __init__(self, tensors):
            super().__init__(tensors)
            made.append(self)

    monkeypatch.setattr(into_live, "Prefault", Recorded)

    def trained(seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        return {"model": model, "optim": opt}

    saved = trained(0)
    store = CheckpointStore(run_dir)
    store.save(1, saved)
    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6)))
    fresh = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    load(store, store.latest_good(), fresh)
    assert [len(pf._tensors) for pf in made] == [36]  # exp_avg, exp_avg_sq, step of 12 parameters
    assert sum(t.nbytes >= MIN_BYTES for t in made[0]._tensors) == 12  # the weights' two moments
    for a, b in zip(saved["model"].state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p_saved, p_fresh in zip(saved["model"].parameters(), model.parameters(), strict=True):
        for k, v in saved["optim"].state[p_saved].items():
            assert torch.equal(v, fresh["optim"].state[p_fresh][k]), k
