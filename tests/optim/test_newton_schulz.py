"""Newton-Schulz: the reference's ops, the singular-value band, batched == per-matrix, batches."""

import sys

import pytest
import torch

from optim.newton_schulz import newton_schulz, ns_batches, ns_dtype, orthogonalize

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


def test_ns_batches_group_one_wide_shape_in_first_appearance_order(monkeypatch):
    mats = [torch.zeros(*s) for s in [(4, 8), (8, 4), (4, 8), (200, 100), (200, 100), (8, 4)]]
    ids = {id(m): i for i, m in enumerate(mats)}

    def indices(batches):
        return [[ids[id(m)] for m in batch] for batch in batches]

    # A tall matrix and a wide one of the transposed shape share a batch.
    assert indices(ns_batches(mats, batched=True)) == [[0, 1, 2, 5], [3, 4]]
    assert indices(ns_batches(mats, batched=False)) == [[0], [1], [2], [5], [3], [4]]
    # Auto on CPU in float32: a bmm chain only pays off for small matrices (optim/newton_schulz.py);
    # in bfloat16 it paid off at every size measured.
    assert indices(ns_batches(mats)) == [[0, 1, 2, 5], [3], [4]]
    assert indices(ns_batches(mats, dtype=torch.bfloat16)) == [[0, 1, 2, 5], [3, 4]]
    # The stack of a batch is bounded: 4x8 float32 is 128 bytes, so 300 bytes hold two.
    monkeypatch.setattr(sys.modules["optim.newton_schulz"], "MAX_STACK_BYTES", 300)
    assert indices(ns_batches(mats, batched=True)) == [[0, 1], [2, 5], [3], [4]]


def test_ns_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert ns_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert ns_dtype("float32", torch.device("cuda")) == torch.float32
    assert ns_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_batched_equals_per_matrix_bitwise_in_float32_on_cpu_transposed_pairs_included(ref_ns):
    """Each matrix is normalised in its own orientation before the stack, so the batch changes
    no rounding: the default CPU path stays bitwise the reference's."""
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(*s, generator=g) for s in [(12, 20), (20, 12), (12, 20), (20, 12), (12, 20)]]
    batched = orthogonalize(mats)
    for m, q in zip(mats, batched, strict=True):
        assert q.shape == m.shape and torch.equal(q, ref_ns(m))


def test_bfloat16_batched_agrees_with_per_matrix_to_bfloat16_precision():
    g = torch.Generator().manual_seed(5)
    mats = [torch.randn(*s, generator=g) for s in [(16, 40), (40, 16), (16, 40)]]
    for m, q in zip(mats, orthogonalize(mats, dtype=torch.bfloat16), strict=True):
        (single,) = orthogonalize([m], dtype=torch.bfloat16)
        assert q.dtype == torch.float32 and q.shape == m.shape
        assert (q - single).norm() / single.norm() < 2e-2


def test_stack_of_matrices_matches_each_matrix(ref_ns):
    G = torch.randn(5, 16, 40, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(G)
    for i in range(5):
        torch.testing.assert_close(out[i], ref_ns(G[i]), rtol=1e-5, atol=1e-6)


def test_results_come_back_in_the_input_dtype():
    mats = [torch.randn(8, 8, dtype=torch.bfloat16) for _ in range(2)]
    assert all(q.dtype == torch.bfloat16 for q in orthogonalize(mats))


@pytest.mark.parametrize("by_layout", [True, False])
def test_bfloat16_iteration_agrees_with_float32_whichever_kernel_layout_it_takes(monkeypatch, by_layout):
    """The bfloat16 iteration feeds torch's own CPU kernel transposed views of the symmetric A and
    B (and a column-major copy of X) where that kernel runs, the plain products elsewhere: both
    are the float32 iteration to bfloat16 precision, single and batched, tall matrices included."""
    module = sys.modules["optim.newton_schulz"]
    monkeypatch.setattr(module, "_torch_own_bfloat16_products", lambda: by_layout)
    g = torch.Generator().manual_seed(6)
    mats = [torch.randn(*s, generator=g) for s in [(24, 56), (56, 24), (24, 56)]]
    for m, batched in zip(mats, orthogonalize(mats, dtype=torch.bfloat16), strict=True):
        exact = newton_schulz(m)
        for q in (batched, newton_schulz(m, dtype=torch.bfloat16).float()):
            assert (q - exact).norm() / exact.norm() < 2e-2
