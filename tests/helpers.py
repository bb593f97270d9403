"""Small shared test helpers that start no process (those are in procs.py): seeded random tensors
and parameters for the optimizer tests, the one-byte damage a checkpoint's verification must
find, and faked GPU generators, host-memory registrations and events for the GPU paths' tests on a
machine without a GPU."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def random_tensors(shapes, seed: int) -> list[torch.Tensor]:
    """One standard-normal tensor per shape, drawn in order from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    """`random_tensors(shapes, seed)` as parameters: the same values for the same seed."""
    return [torch.nn.Parameter(t) for t in random_tensors(shapes, seed)]


def flip_byte(path: str | Path, at: int = -3, mask: int = 0x01) -> None:
    """Damage the file at `path` in place: the byte at index `at` XOR `mask`, the size unchanged (so
    only the content hash can tell)."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


class FakeGpus:
    """`count` visible GPUs as torch.cuda's generator functions see them: each index its own
    16-byte state (index i starts as bytes of i)."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        for name, fn in {"is_available": lambda: True, "device_count": lambda: count, "current_device": lambda: 0,
                         "get_rng_state": self.get, "set_rng_state": self.set, "manual_seed_all": lambda seed: None,
                         "get_rng_state_all": lambda: [self.get(i) for i in range(count)],
                         "set_rng_state_all": lambda states: [self.set(s, i) for i, s in enumerate(states)]}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def index(self, device) -> int:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        assert device.type == "cuda"
        index = 0 if device.index is None else device.index
        assert index in self.states, f"cuda:{index} is not visible"
        return index

    def get(self, device="cuda") -> torch.Tensor:
        return self.states[self.index(device)].clone()

    def set(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self.index(device)] = state.clone()


class Registrations:
    """cudaHostRegister / cudaHostUnregister, recorded: (address, bytes) registered, addresses
    unregistered; `refuse_after` registrations succeed, the next fails."""

    def __init__(self, monkeypatch, refuse_after: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.refuse_after = refuse_after
        from harness.checkpoint import host_memory

        monkeypatch.setattr(host_memory, "_register", self.register)
        monkeypatch.setattr(host_memory, "_unregister", self.unregistered.append)

    def register(self, address: int, nbytes: int) -> bool:
        if self.refuse_after is not None and len(self.registered) >= self.refuse_after:
            return False
        self.registered.append((address, nbytes))
        return True


class FakeCudaEvent:
    """torch.cuda.Event as CUDA documents cudaEventSynchronize: a thread waiting on an event made
    without cudaEventBlockingSync busy-waits, one made with it sleeps. `record` completes the
    event `delay_s` later (a copy in flight)."""

    delay_s = 0.3

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.blocking = blocking
        self.done_at = 0.0
        self.recorded_on = None

    def record(self, stream=None) -> None:
        self.recorded_on = stream
        self.done_at = time.monotonic() + self.delay_s

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        while not self.query():
            if self.blocking:
                time.sleep(0.01)
