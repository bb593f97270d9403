"""Lion: the reference rule bitwise on a small random problem, any parameter shape."""

import pytest
import torch

from helpers import make_params, random_tensors
from optim.lion import Lion

SHAPES = [(8, 16), (16,), (3, 4, 5)]


def grads_for(step):
    return random_tensors(SHAPES, 200 + step)


def reference_lion(steps, lr, betas, wd):
    """Direct formula: u = sign(b1 m + (1-b1) g); decay; p -= lr u; then m = b2 m + (1-b2) g."""
    b1, b2 = betas
    params = [p.detach().clone() for p in make_params(SHAPES)]
    ms = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        for p, m, g in zip(params, ms, grads_for(step), strict=True):
            u = torch.sign(b1 * m + (1 - b1) * g)
            if wd > 0:
                p.mul_(1 - lr * wd)
            p.add_(u, alpha=-lr)
            m.mul_(b2).add_(g, alpha=1 - b2)
    return params


@pytest.mark.parametrize(("lr", "betas", "wd"), [(3e-4, (0.9, 0.99), 0.0), (1e-2, (0.8, 0.95), 0.1)])
def test_update_is_bitwise_the_reference_rule(lr, betas, wd):
    params = make_params(SHAPES)
    opt = Lion(params, lr=lr, betas=betas, wd=wd)
    for step in range(4):
        for p, g in zip(params, grads_for(step), strict=True):
            p.grad = g
        opt.step()
    for x, y in zip(params, reference_lion(4, lr, betas, wd), strict=True):
        assert torch.equal(x.detach(), y)


def test_first_step_moves_every_entry_by_exactly_lr():
    # m starts at zero, so the first update is sign(g): Lion's defining fixed-size step.
    p = torch.nn.Parameter(torch.zeros(5, 7))
    p.grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    Lion([p], lr=0.01).step()
    assert torch.equal(p.detach(), -0.01 * torch.sign(p.grad))
