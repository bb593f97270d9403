"""Adafactor2D: the reference rule (with its host-side float() branches) bitwise, both with and
without update clipping; float32 statistics; 2D only."""

import pytest
import torch

from helpers import make_params, random_tensors
from optim.adafactor import Adafactor2D

SHAPES = [(8, 16), (16, 8), (12, 12)]


def grads_for(step):
    return random_tensors(SHAPES, 400 + step)


def reference_adafactor(steps, lr, beta2, eps, clip, wd):
    """The reference's step, including its float() max and clip branch."""
    params = [p.detach().clone() for p in make_params(SHAPES)]
    rs = [torch.zeros(p.shape[0]) for p in params]
    cs = [torch.zeros(p.shape[1]) for p in params]
    clipped = 0
    for step in range(steps):
        for p, r, c, g in zip(params, rs, cs, grads_for(step), strict=True):
            g2 = g.float().pow(2) + eps
            r.mul_(beta2).add_(g2.mean(1), alpha=1 - beta2)
            c.mul_(beta2).add_(g2.mean(0), alpha=1 - beta2)
            v = r[:, None] * c[None, :] / max(float(r.mean()), eps)
            u = g / v.sqrt().to(g.dtype)
            rms = float(u.pow(2).mean().sqrt())
            if rms > clip:
                u = u * (clip / rms)
                clipped += 1
            if wd > 0:
                p.mul_(1 - lr * wd)
            p.add_(u, alpha=-lr)
    return params, rs, cs, clipped


# beta2=0.999 from zero statistics clips every step (u ~ 1/sqrt(1-beta2)); beta2=0 with a loose
# clip never does: both branches of the reference are covered.
@pytest.mark.parametrize(("beta2", "clip", "wd", "clips"),
                         [(0.999, 1.0, 0.0, "all"), (0.0, 4.0, 0.1, "none"), (0.9, 0.5, 0.0, "all")])
def test_update_is_bitwise_the_reference_rule(beta2, clip, wd, clips):
    params = make_params(SHAPES)
    opt = Adafactor2D(params, lr=1e-2, beta2=beta2, clip=clip, wd=wd)
    for step in range(3):
        for p, g in zip(params, grads_for(step), strict=True):
            p.grad = g
        opt.step()
    expected, rs, cs, clipped = reference_adafactor(3, 1e-2, beta2, 1e-30, clip, wd)
    assert clipped == {"all": 3 * len(SHAPES), "none": 0}[clips]
    for p, x, r, c in zip(params, expected, rs, cs, strict=True):
        assert torch.equal(p.detach(), x)
        assert torch.equal(opt.state[p]["r"], r) and torch.equal(opt.state[p]["c"], c)


def test_statistics_stay_float32_for_bfloat16_parameters():
    p = torch.nn.Parameter(torch.randn(4, 6).bfloat16())
    p.grad = torch.randn(4, 6).bfloat16()
    opt = Adafactor2D([p])
    opt.step()
    assert opt.state[p]["r"].dtype == torch.float32 and p.dtype == torch.bfloat16


def test_non_2d_parameter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Adafactor2D only takes 2D parameters, but 'emb'"):
        Adafactor2D([("emb", torch.nn.Parameter(torch.zeros(2, 2, 2)))])
