"""prefault.py: the new tensors a load reads into are faulted in by a second thread, which never
writes a tensor the load has taken; a load into a fresh optimizer (a resumed process's) goes
through it and is bitwise; tensors made ahead (`fault_ahead`) are taken where they fit."""

from __future__ import annotations

import threading
import time

import torch

import harness.checkpoint.prefault as prefault
from harness.checkpoint import CheckpointStore, fault_ahead, load
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


def trained(seed: int, width: int = 512) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(6)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def built(seed: int, width: int = 512) -> dict:
    """What a resumed process holds before its load: a model, an optimizer with no state yet."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(6)))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def assert_loaded(saved: dict, fresh: dict) -> None:
    for a, b in zip(saved["model"].state_dict().values(), fresh["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p_saved, p_fresh in zip(saved["model"].parameters(), fresh["model"].parameters(), strict=True):
        for k, v in saved["optim"].state[p_saved].items():
            assert torch.equal(v, fresh["optim"].state[p_fresh][k]), k


def recorded_prefaults(monkeypatch) -> list[Prefault]:
    made: list[Prefault] = []

    class Recorded(Prefault):
        def __init__(self, tensors):
            super().__init__(tensors)
            made.append(self)

    monkeypatch.setattr(prefault, "Prefault", Recorded)
    return made


def test_a_fresh_optimizer_loads_bitwise_through_the_prefault(run_dir, monkeypatch):
    """A resumed process: the model exists, the optimizer has no state yet, so its moments are
    read into new tensors, which the thread faults in."""
    made = recorded_prefaults(monkeypatch)
    saved = trained(0)
    store = CheckpointStore(run_dir)
    store.save(1, saved)
    fresh = built(1)
    load(store, store.latest_good(), fresh)
    assert [len(pf._tensors) for pf in made] == [36]  # exp_avg, exp_avg_sq, step of 12 parameters
    assert sum(t.nbytes >= MIN_BYTES for t in made[0]._tensors) == 12  # the weights' two moments
    assert_loaded(saved, fresh)


def test_tensors_made_ahead_are_the_ones_the_load_reads_the_optimizer_into(run_dir, monkeypatch):
    """A resume makes the optimizer's tensors before it builds the trainer (`fault_ahead`): the
    load reads into those, bitwise, and makes none of its own; the model's live tensors stay."""
    saved = trained(0)
    store = CheckpointStore(run_dir)
    store.save(1, saved)
    checkpoint = store.open(store.latest_good())
    with fault_ahead(store.loc, checkpoint, ["optim"]) as ahead:
        made_ahead = {id(t) for t in ahead._prefault._tensors}
        assert len(made_ahead) == 36
        fresh = built(1)
        weights = [p.data_ptr() for p in fresh["model"].parameters()]
        late = recorded_prefaults(monkeypatch)
        load(store, checkpoint, fresh, ahead=ahead)
    assert [len(pf._tensors) for pf in late] == [0]
    assert {id(v) for st in fresh["optim"].state.values() for v in st.values()} == made_ahead
    assert ahead.taken == sum(v.nbytes for st in fresh["optim"].state.values() for v in st.values())
    assert [p.data_ptr() for p in fresh["model"].parameters()] == weights
    assert_loaded(saved, fresh)


def test_tensors_made_ahead_that_do_not_fit_are_dropped_and_the_load_makes_its_own(run_dir, monkeypatch):
    """Made from another checkpoint's headers (other shapes), or for a part whose tensors are live
    (the model's): none is taken but the 12 `step` counts (their shape, (), is the same), and the
    load is the same."""
    store, other = CheckpointStore(f"{run_dir}/a"), CheckpointStore(f"{run_dir}/b")
    saved = trained(0)
    store.save(1, saved)
    other.save(1, trained(0, width=256))
    with fault_ahead(other.loc, other.open(other.latest_good()), ["model", "optim"]) as ahead:
        late = recorded_prefaults(monkeypatch)
        fresh = built(1)
        load(store, store.latest_good(), fresh, ahead=ahead)
    assert ahead.taken == 12 * 4 and not ahead._index
    assert [len(pf._tensors) for pf in late] == [24]
    assert_loaded(saved, fresh)


def test_nothing_is_made_ahead_off_local_disk_or_for_parts_not_stored(run_dir):
    store = CheckpointStore(run_dir)
    store.save(1, trained(0, width=64))
    assert fault_ahead(store.loc, store.open(store.latest_good()), ["scheduler"]) is None
    remote = CheckpointStore("memory://fault-ahead")
    remote.save(1, trained(0, width=64))
    assert fault_ahead(remote.loc, remote.open(remote.latest_good()), ["optim"]) is None
