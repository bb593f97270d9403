"""Warmup + cosine multiplier: the reference's lambda, value for value."""

import math

import pytest

from optim.schedule import warmup_cosine


def reference_multiplier(warmup, total_steps, lr_min_ratio):
    """The reference build_hybrid/build_alt lambda, verbatim."""
    if total_steps > 0:
        def fn(s):
            if s < warmup:
                return (s + 1) / max(warmup, 1)
            p = min(1.0, (s - warmup) / max(1, total_steps - warmup))
            return lr_min_ratio + 0.5 * (1 - lr_min_ratio) * (1 + math.cos(math.pi * p))
    else:
        def fn(s):
            return min(1.0, (s + 1) / max(warmup, 1))
    return fn


@pytest.mark.parametrize(("warmup", "total", "ratio"),
                         [(0, 0, 0.1), (5, 0, 0.1), (0, 20, 0.1), (5, 20, 0.1), (5, 20, 0.0),
                          (20, 20, 0.3), (30, 20, 0.1)])
def test_equals_the_reference_at_every_step(warmup, total, ratio):
    ours, ref = warmup_cosine(warmup, total, ratio), reference_multiplier(warmup, total, ratio)
    assert [ours(s) for s in range(40)] == [ref(s) for s in range(40)]


def test_shape():
    f = warmup_cosine(4, 14, 0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.55)
    assert f(14) == f(100) == pytest.approx(0.1)
    assert [warmup_cosine(2, 0, 0.1)(s) for s in (0, 1, 50)] == [0.5, 1.0, 1.0]
