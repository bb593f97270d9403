"""The trainer's deterministic mode without torch's NaN fill of uninitialised memory: the fill
cost 2-3% of a quickstart step (docs/bench-overhead.md) and changes no result."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_config
from harness.repro import numerics
from harness.run.trainer import Trainer

TINY = "tests/data/tiny.toml"


def losses_and_params(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    t = Trainer(cfg)
    try:
        losses = [t.train_step().loss for _ in range(4)]
        return losses, {k: v.clone() for k, v in t.model.state_dict().items()}
    finally:
        t.close()


@pytest.mark.parametrize("arm", ["adamw", "muon"])
def test_no_nan_fill_and_the_same_bits_as_with_it(tmp_path, monkeypatch, arm):
    cfg = load_config(TINY, [f"optim.type={arm}", f"run_dir={str(tmp_path)!r}"])
    fast = losses_and_params(cfg)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is False

    apply = numerics.apply

    def with_nan_fill(threads=None):  # what the harness did before
        settings = apply(threads)
        torch.utils.deterministic.fill_uninitialized_memory = True
        return settings

    monkeypatch.setattr(numerics, "apply", with_nan_fill)
    try:
        filled = losses_and_params(cfg)
        assert torch.utils.deterministic.fill_uninitialized_memory is True
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = False
    assert fast[0] == filled[0]
    assert fast[1].keys() == filled[1].keys() and all(torch.equal(fast[1][k], filled[1][k]) for k in fast[1])
