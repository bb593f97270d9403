"""Newton-Schulz: the reference's ops, the singular-value band, batched == per-matrix."""

import pytest
import torch

from optim.newton_schulz import newton_schulz, orthogonalize

SHAPES = [(8, 16), (16, 8), (12, 12), (32, 64), (64, 32)]


@pytest.mark.parametrize("shape", SHAPES)
def test_single_matrix_is_bitwise_the_reference(shape, ref_ns):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(newton_schulz(G), ref_ns(G))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_land_in_the_quintic_band(shape, dtype):
    # The coefficients trade convergence for speed: five steps leave every singular value of a
    # well-conditioned input oscillating in about [0.68, 1.14] (Jordan's post), not at 1.
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(G, dtype=dtype).float())
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())


def test_more_steps_do_not_leave_the_band():
    G = torch.randn(24, 40, generator=torch.Generator().manual_seed(2))
    s = torch.linalg.svdvals(newton_schulz(G, steps=12))
    assert s.min() > 0.6 and s.max() < 1.2


def test_batched_equals_per_matrix_in_input_order(ref_ns):
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(*SHAPES[i % 3], generator=g) for i in range(7)]
    looped = orthogonalize(mats, batched=False)
    batched = orthogonalize(mats, batched=True)
    auto = orthogonalize(mats)
    for m, x, y, z in zip(mats, looped, batched, auto):
        assert x.shape == m.shape
        assert torch.equal(x, ref_ns(m))
        # bmm and mm may sum in different orders on other backends; on CPU they agree bitwise.
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(z, x, rtol=1e-5, atol=1e-6)


def test_stack_of_matrices_matches_each_matrix(ref_ns):
    G = torch.randn(5, 16, 40, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(G)
    for i in range(5):
        torch.testing.assert_close(out[i], ref_ns(G[i]), rtol=1e-5, atol=1e-6)


def test_results_come_back_in_the_input_dtype():
    mats = [torch.randn(8, 8, dtype=torch.bfloat16) for _ in range(2)]
    assert all(q.dtype == torch.bfloat16 for q in orthogonalize(mats))
