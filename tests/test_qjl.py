import math

import pytest
import torch

from flashquant_hf.qjl import QJLSketch


def test_estimator_is_unbiased_over_1e5_pairs(gen):
    """Mean estimate over mean true inner product within 1%, over 10^5 pairs and 1000 independent sketches.

    Unbiasedness is over the draw of S: one fixed S carries a realisation-dependent bias of about 1%, so the
    pairs are spread over many seeds. Pairs are correlated so <q, r> stays away from 0.
    """
    g = gen
    sketches, per_sketch, d = 1000, 100, 64
    base = int(torch.randint(0, 10**6, (), generator=gen))
    est, true = [], []
    for i in range(sketches):
        r = torch.randn(per_sketch, d, generator=g)
        q = r + 0.8 * torch.randn(per_sketch, d, generator=g)
        sketch = QJLSketch(d, seed=base + i)
        est.append(sketch.inner_product(q, *sketch.encode(r)).double())
        true.append((q * r).sum(-1).double())
    est, true = torch.cat(est), torch.cat(true)
    assert est.mean().item() / true.mean().item() == pytest.approx(1.0, abs=0.01)
    # a wrong scale (e.g. S divided by sqrt(m), or sqrt(pi/2) dropped) is off by 20% or more
    assert (est / true).median().item() == pytest.approx(1.0, abs=0.05)


def test_error_shrinks_with_more_projections():
    g = torch.Generator().manual_seed(3)
    r, q = torch.randn(4000, 64, generator=g), torch.randn(4000, 64, generator=g)
    true = (q * r).sum(-1)
    errors = []
    for m in (64, 512):
        sk = QJLSketch(64, m=m, seed=1)
        errors.append((sk.inner_product(q, *sk.encode(r)) - true).pow(2).mean().sqrt().item())
    assert errors[1] < errors[0] / 2  # variance ~ 1/m: 8x more projections, ~2.8x less error
    # Var = (pi/2) ||r||^2 (||q||^2 - (2/pi) <q, r/||r||>^2) / m; here q is nearly orthogonal to r,
    # ||q||^2 ~ ||r||^2 ~ 64
    expected = math.sqrt(math.pi / 2 / 64) * 64
    assert errors[0] == pytest.approx(expected, rel=0.25)


def test_bad_shapes(gen):
    with pytest.raises(ValueError, match="multiple of 8"):
        QJLSketch(64, m=12)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        QJLSketch(64).encode(torch.randn(3, 32, generator=gen))
