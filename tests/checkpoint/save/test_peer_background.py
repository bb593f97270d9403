"""The local tier's peer copies in the background (checkpoint/save/peer_copies.py, local_tier.py),
one process: the wire (`transfer`) is a stand-in, the threads and the waits are the real ones.
A local save returns while its exchange runs; the next save, a `drop_after` and the end of the
run wait for it, so retention never deletes a checkpoint being sent; a damaged copy is dropped
and the copies go on; any other failure is logged and stops them, training goes on; an error
exit does not wait for a stuck exchange. The real wire between two ranks:
tests/distributed/test_peer_copies.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from harness.checkpoint import CheckpointStore
from harness.checkpoint.errors import CheckpointCorrupt
from harness.checkpoint.save import local_tier, peer_copies
from harness.checkpoint.save.local_tier import LocalTier
from harness.config import LocalTierSection

RUN = "run-a"


class Wire:
    """Stands in for `transfer`: records the steps sent, holds the exchange of `hold` until
    `gate` is set, raises `raises[step]` for a step, and checks that the files it is sending
    are still there once let go (retention must not have deleted them meanwhile)."""

    def __init__(self, hold: int | None = None, raises: dict[int, Exception] | None = None) -> None:
        self.hold, self.raises, self.gate = hold, raises or {}, threading.Event()
        self.sent: list[int] = []
        self.files_there: dict[int, bool] = {}

    def __call__(self, outgoing, incoming):
        step = outgoing.ref.step
        self.sent.append(step)
        if step == self.hold:
            assert self.gate.wait(30)
        self.files_there[step] = (Path(outgoing.ref.path) / "model.safetensors").exists()
        if step in self.raises:
            raise self.raises[step]


@pytest.fixture
def tier(tmp_path, monkeypatch):
    """A local tier of one process with peer copies on (to its own rank: the wire is `Wire`), keep 2."""
    monkeypatch.setattr(local_tier, "peer_jump", lambda section, world: 1)
    monkeypatch.setattr(peer_copies, "peer_group", lambda: None)
    made = LocalTier(LocalTierSection(dir=str(tmp_path), every_steps=2, keep=2), RUN, resumed_step=0)
    yield made
    made.close()


def wire(monkeypatch, **kwargs) -> Wire:
    w = Wire(**kwargs)
    monkeypatch.setattr(peer_copies, "transfer", w)
    return w


def save(tier: LocalTier, step: int):
    return tier.save(step, {"model": torch.nn.Linear(2, 2)}, {})


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def until(condition, timeout: float = 30.0) -> None:
    """Wait for `condition()` to hold (what another thread does next has no fixed time)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def steps(tier: LocalTier) -> list[int]:
    return [ref.step for ref in tier.store.list()]


def test_a_save_returns_while_its_exchange_runs_and_the_next_save_waits_for_it(tier, monkeypatch):
    w = wire(monkeypatch, hold=4)
    save(tier, 2)
    submitted = save(tier, 4)  # waited for the exchange of 2 (not held), starts that of 4
    assert tier.peers.job.busy
    until(lambda: w.sent == [2, 4])  # the exchange thread has reached the (held) wire
    assert submitted.waited_s < 5
    results = []
    t = in_thread(lambda: results.append(save(tier, 6)))
    time.sleep(0.5)
    # Retention (keep 2) would delete step 4, which is being sent: the save of 6 has not begun.
    assert t.is_alive() and steps(tier) == [2, 4]
    w.gate.set()
    t.join(30)
    (after,) = results
    tier.finish()  # the exchange of 6 runs in the background after its save returned
    assert not tier.peers.job.busy
    assert w.files_there == {2: True, 4: True, 6: True} and w.sent == [2, 4, 6]
    assert steps(tier) == [4, 6]
    assert after.waited_s >= 0.4 and after.blocking_s >= after.waited_s


def test_drop_after_and_the_end_of_the_run_wait_for_the_exchange(tier, monkeypatch):
    w = wire(monkeypatch, hold=4)
    save(tier, 2)
    save(tier, 4)
    dropping = in_thread(tier.drop_after, 2)  # a rollback to step 2 while 4 is being sent
    time.sleep(0.5)
    assert dropping.is_alive() and steps(tier) == [2, 4]
    w.gate.set()
    dropping.join(30)
    assert w.files_there[4] and steps(tier) == [2]
    w2 = wire(monkeypatch, hold=6)
    save(tier, 6)
    finishing = in_thread(tier.finish)
    time.sleep(0.5)
    assert finishing.is_alive()
    w2.gate.set()
    finishing.join(30)
    assert not finishing.is_alive() and w2.sent == [6]


def test_a_damaged_copy_is_dropped_and_the_copies_go_on(tier, monkeypatch):
    w = wire(monkeypatch, raises={2: CheckpointCorrupt("the copy from rank 0 does not match its manifest")})
    with capture_logs() as logs:
        save(tier, 2)
        save(tier, 4)
        tier.finish()
    assert w.sent == [2, 4] and not tier.peers.stopped
    assert [e["step"] for e in logs if e["event"] == "peer copy dropped"] == [2]


def test_a_failed_exchange_is_logged_and_stops_the_copies_training_goes_on(tier, monkeypatch):
    """A gloo error (the partner died): no exception reaches the step loop, no later exchange
    is tried (the pair's messages would no longer match), the local saves go on."""
    w = wire(monkeypatch, raises={2: RuntimeError("Connection closed by peer [127.0.0.1]:29500")})
    with capture_logs() as logs:
        save(tier, 2)
        save(tier, 4)
        save(tier, 6)
        tier.finish()
    assert w.sent == [2] and tier.peers.stopped and steps(tier) == [4, 6]
    (warning,) = [e for e in logs if e["event"].startswith("peer copies stopped")]
    assert warning["log_level"] == "warning" and warning["step"] == 2
    assert "RuntimeError: Connection closed by peer" in warning["error"]


def test_an_error_exit_does_not_wait_for_a_stuck_exchange(tier, monkeypatch):
    monkeypatch.setattr(peer_copies, "CLOSE_WAIT_S", 0.2)
    w = wire(monkeypatch, hold=2)
    save(tier, 2)
    t0 = time.monotonic()
    with capture_logs() as logs:
        tier.close()
    assert time.monotonic() - t0 < 5
    assert [e["step"] for e in logs if e["event"] == "peer copy abandoned at an error exit"] == [2]
    w.gate.set()


def test_a_file_travels_in_messages_of_the_chunk_size_and_arrives_whole(tmp_path, monkeypatch):
    """`transfer` over a loopback wire (this rank to itself: the k-th message out is the k-th in):
    a 1 MiB tensor file and state.json cut into messages of at most 64 KiB each way, the copy
    committed with the sender's digests."""
    monkeypatch.setattr(peer_copies, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(peer_copies, "peer_group", lambda: None)
    wire_queue: list[torch.Tensor] = []
    sizes: list[int] = []

    def loopback(group, to, out, sender, into):
        if out is not None and out.numel():
            sizes.append(out.numel())
            wire_queue.append(out.clone())
        if into is not None and into.numel():
            into.copy_(wire_queue.pop(0))
        return into

    monkeypatch.setattr(peer_copies, "_swap", loopback)
    source = CheckpointStore(str(tmp_path / "own"))
    source.save(2, {"model": {"w": torch.randn(1 << 18)}})  # 1 MiB
    inbox = CheckpointStore(str(tmp_path / "inbox"))
    ref = peer_copies.transfer(peer_copies.Outgoing(0, source, source.ref(2)), peer_copies.Incoming(0, inbox))
    assert inbox.manifest(ref).files == source.manifest(source.ref(2)).files and inbox.verify(ref) == []
    assert max(sizes[2:]) == 64 << 10 and len(sizes) > 2 + (1 << 20) // (64 << 10)  # after the manifest's two
