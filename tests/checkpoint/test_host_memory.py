"""Host memory between a GPU and files (harness/checkpoint/host_memory.py), on a machine without a
GPU: CUDA's registration calls and events are faked, so what is checked is what the harness asks
of CUDA (exact sizes, memory given back, blocking events, a piece lent again only when free)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from structlog.testing import capture_logs

from harness.checkpoint import host_memory
from harness.checkpoint.host_memory import HostBlock, LentPieces, copies_done
from helpers import FakeCudaEvent, Registrations


@pytest.fixture
def fake_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)


def test_a_pinned_block_is_exactly_its_size_registered_in_pieces_and_given_back(monkeypatch):
    """Not a power of two (torch's pinned allocator rounds 2.5 MiB + 3 up to 4 MiB), registered in
    pieces of REGISTER_BYTES (each call holds the driver's lock), unregistered on release."""
    cuda = Registrations(monkeypatch)
    monkeypatch.setattr(host_memory, "REGISTER_BYTES", 1 << 20)
    nbytes = (5 << 19) + 3
    block = HostBlock(nbytes, pinned=True)
    assert block.pinned and block.tensor is not None and block.tensor.numel() == nbytes
    base = block.tensor.data_ptr()
    assert cuda.registered == [(base, 1 << 20), (base + (1 << 20), 1 << 20), (base + (2 << 20), (1 << 19) + 3)]
    block.release()
    assert cuda.unregistered == [base, base + (1 << 20), base + (2 << 20)] and block.tensor is None


def test_a_dropped_block_is_given_back_and_a_refused_one_stays_pageable(monkeypatch):
    cuda = Registrations(monkeypatch, refuse_after=1)
    monkeypatch.setattr(host_memory, "REGISTER_BYTES", 1 << 20)
    with capture_logs() as logs:
        block = HostBlock(3 << 20, pinned=True)
    assert not block.pinned and cuda.unregistered == [cuda.registered[0][0]]  # the piece that was pinned
    assert any("could not pin" in log["event"] for log in logs)
    assert torch.count_nonzero(block.tensor) == 0  # pageable: its pages faulted in at once
    cuda.refuse_after = None
    pinned = HostBlock(1 << 20, pinned=True)
    address = pinned.tensor.data_ptr()
    del pinned
    gc.collect()
    assert cuda.unregistered[-1] == address


def test_copies_done_is_an_event_a_waiting_thread_sleeps_on(fake_events):
    stream = object()
    event = copies_done(stream)
    assert event.blocking and event.recorded_on is stream


def test_a_lent_piece_comes_back_once_nothing_holds_it_and_its_copy_is_done(fake_events):
    """A hash behind the reads holds a piece's view after the reader let go: the piece is not lent
    again before, and not before the copy out of it recorded on it is done."""
    pieces = LentPieces(1, 1 << 10, pinned=False)
    view, piece, copied = pieces.borrow(100)
    assert len(view) == 100 and piece.numel() == 100
    held_by_hash = view[:10]
    event = FakeCudaEvent(blocking=True)
    event.record()
    copied(event)
    del view, piece
    got = []
    borrower = threading.Thread(target=lambda: got.append(pieces.borrow(50)))
    borrower.start()
    borrower.join(0.2)
    assert borrower.is_alive() and not got  # the hash still holds it
    del held_by_hash
    borrower.join(5)
    assert got and event.query()  # lent again, after the copy's event
