"""BufferProbe: which non-persistent buffers carry state from one forward to the next; updated_buffers:
which buffers, persistent ones included, a forward updates (exact elastic mode's probe)."""

import pytest
import torch
from torch import nn

from harness.repro.buffer_probe import BufferProbe, non_persistent_buffers, updated_buffers


class Buffers(nn.Module):
    """One non-persistent buffer per way real models use them, and a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for name in ("mask", "table", "ema", "stat", "part", "lazy"):
            self.register_buffer(name, torch.zeros(4), persistent=False)
        self.register_buffer("saved", torch.zeros(4))
        self.lazy_ready = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask.copy_(torch.ones_like(self.mask))             # a cache rebuilt before it is read
        y = self.lin(x) * self.mask + self.table                # a constant: read, never written
        self.ema.lerp_(y.detach().mean(0), 0.1)                 # read and updated in place: state
        self.stat.copy_(0.9 * self.stat + y.detach().mean(0))   # read, then overwritten: state
        self.part[:2].fill_(1.0)                                 # half overwritten, then read: state
        y = y + self.part
        if not self.lazy_ready:                                  # filled once per process, then read
            self.lazy.fill_(2.0)
            self.lazy_ready = True
        self.saved.add_(1.0)                                     # persistent: the checkpoint has it
        return y * self.lazy


def test_names_the_buffers_forward_reads_before_writing_and_then_writes():
    model = Buffers()
    assert sorted(non_persistent_buffers(model)) == ["ema", "lazy", "mask", "part", "stat", "table"]
    probe = BufferProbe(model)
    out = model(torch.ones(3, 4))
    assert probe.done and probe.stateful == ["model.ema", "model.part", "model.stat"]
    again = model(torch.ones(3, 4))  # the probe watched one forward only and is gone
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert out.shape == again.shape


def test_the_watched_forward_computes_the_same_numbers():
    torch.manual_seed(0)
    a = Buffers()
    b = Buffers()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4)
    BufferProbe(b)
    assert torch.equal(a(x), b(x))
    assert all(torch.equal(p, q) for p, q in zip(a.buffers(), b.buffers(), strict=True))


def test_a_forward_that_raises_leaves_no_mode_behind():
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ema", torch.zeros(2), persistent=False)

        def forward(self, x):
            self.ema.mul_(0.5)
            raise ValueError("boom")

    model = Fails()
    probe = BufferProbe(model)
    with pytest.raises(ValueError):
        model(torch.ones(2))
    assert probe.done and probe.stateful == ["model.ema"]
    assert torch.ones(2).add(1).sum() == 4  # ops run without the probe's mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


class Replaces(nn.Module):
    """Buffers a forward updates by assigning a new tensor to the attribute, not in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4), persistent=False)
        self.register_buffer("rebuilt", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)  # read, then replaced: state
        self.rebuilt = torch.ones(4)                           # replaced without being read: a cache
        return x * self.rebuilt + self.ema


def test_a_buffer_replaced_by_a_value_computed_from_it_carries_state():
    model = Replaces()
    probe = BufferProbe(model)
    model(torch.ones(3, 4))
    assert probe.done and probe.stateful == ["model.ema"]


class Stateful(nn.Module):
    """Every way a forward keeps state in buffers, persistent or not, beside ones it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.arange(4.0))
        self.register_buffer("mask", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask.copy_(torch.ones_like(self.mask))                # a cache rebuilt before it is read
        y = self.norm(x) * self.mask + self.table                  # a constant: read, never written
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)       # replaced by a value computed from it
        self.count += 1                                            # a counter
        return y


def test_updated_buffers_names_what_a_forward_updates_and_puts_every_buffer_back():
    """Batch-norm statistics (written through arguments `native_batch_norm`'s schema calls
    read-only: seen by their bits), a replaced EMA and a counter; not a constant nor a rebuilt
    cache. Afterwards every buffer is the same tensor, with the same bits."""
    torch.manual_seed(0)
    model = Stateful()
    before = {name: (t, t.clone()) for name, t in model.named_buffers()}
    x = torch.randn(8, 4)
    updated = updated_buffers(model, lambda: model(x))
    assert updated == ["model.count", "model.ema", "model.norm.num_batches_tracked", "model.norm.running_mean",
                       "model.norm.running_var"]
    for name, t in model.named_buffers():
        assert t is before[name][0] and torch.equal(t, before[name][1]), name
    assert updated_buffers(nn.Linear(2, 2), lambda: pytest.fail("no forward without buffers")) == []


def test_updated_buffers_puts_them_back_when_the_forward_raises():
    model = Stateful()
    running = model.norm.running_mean

    def fails():
        model(torch.randn(8, 4))
        raise ValueError("boom")

    with pytest.raises(ValueError):
        updated_buffers(model, fails)
    assert model.norm.running_mean is running and torch.equal(running, torch.zeros(4))
    assert int(model.count) == 0 and torch.equal(model.ema, torch.zeros(4))
