"""OLion: the reference rule bitwise (per-matrix NS), batched within tolerance, 2D only."""

import pytest
import torch

from helpers import make_params, random_tensors
from optim.olion import OLion

SHAPES = [(8, 16), (16, 8), (12, 12), (12, 12)]


def grads_for(step):
    return random_tensors(SHAPES, 300 + step)


def run(steps, **kw):
    params = make_params(SHAPES)
    opt = OLion(params, **kw)
    for step in range(steps):
        for p, g in zip(params, grads_for(step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def reference_olion(ns, steps, lr, betas, gamma, wd):
    """Direct formula: m = b2 m + (1-b2) g first; mix (1-b1) g + b1 m; NS; p -= lr gamma sign."""
    b1, b2 = betas
    params = [p.detach().clone() for p in make_params(SHAPES)]
    ms = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        for p, m, g in zip(params, ms, grads_for(step), strict=True):
            m.mul_(b2).add_(g, alpha=1 - b2)
            q = ns((1 - b1) * g + b1 * m)
            if wd > 0:
                p.mul_(1 - lr * wd)
            p.add_(torch.sign(q), alpha=-lr * gamma)
    return params


@pytest.mark.parametrize(("lr", "betas", "gamma", "wd"),
                         [(1e-3, (0.9, 0.99), 0.2, 0.0), (1e-2, (0.8, 0.9), 0.5, 0.1)])
def test_update_is_bitwise_the_reference_rule(ref_ns, lr, betas, gamma, wd):
    got = run(3, lr=lr, betas=betas, gamma=gamma, wd=wd, ns_batched=False)
    for x, y in zip(got, reference_olion(ref_ns, 3, lr, betas, gamma, wd), strict=True):
        assert torch.equal(x, y)


def test_batched_newton_schulz_gives_the_same_update():
    # sign() makes any NS difference all-or-nothing per entry; on CPU bmm and mm agree bitwise.
    for x, y in zip(run(3, ns_batched=True), run(3, ns_batched=False), strict=True):
        assert torch.equal(x, y)


def test_update_rms_is_lr_times_gamma():
    p = torch.nn.Parameter(torch.zeros(16, 24))
    p.grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    OLion([p], lr=0.1, gamma=0.2).step()
    assert torch.equal(p.detach().abs(), torch.full((16, 24), 0.1 * 0.2))


def test_non_2d_parameter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"OLion only takes 2D parameters, but 'ln\.weight'"):
        OLion([("w", torch.nn.Parameter(torch.zeros(2, 2))),
               ("ln.weight", torch.nn.Parameter(torch.zeros(2)))])


def test_bfloat16_parameters_get_float32_newton_schulz(ref_ns):
    """The docstring's claim: NS in float32 whatever the parameter dtype (the reference: in the
    parameter dtype); the update is the rule with float32 NS, bitwise."""
    start = [p.detach().bfloat16() for p in make_params(SHAPES)]
    grads = [g.bfloat16() for g in grads_for(0)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    OLion(params, ns_batched=False).step()
    for p, start_p, g in zip(params, start, grads, strict=True):
        m = torch.zeros_like(g).mul_(0.99).add_(g, alpha=0.01)
        q = ref_ns(((1 - 0.9) * g + 0.9 * m).float()).bfloat16()
        assert torch.equal(p.detach(), start_p.clone().add_(torch.sign(q), alpha=-1e-3 * 0.2))
