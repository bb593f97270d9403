"""step(closure): every optimizer re-evaluates the loss with gradients on and returns it."""

import pytest
import torch

from optim.adafactor import Adafactor2D
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion


@pytest.mark.parametrize("cls", [Muon, Lion, OLion, Adafactor2D])
def test_step_with_closure_returns_the_loss_and_uses_its_gradients(cls):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([w])
    before = w.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()  # needs grad mode: step() itself runs under no_grad
        return loss

    loss = opt.step(closure)
    assert torch.equal(loss, (before ** 2).sum())
    assert not torch.equal(w.detach(), before)
    assert opt.step() is None
