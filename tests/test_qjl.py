import math

import pytest
import torch

from flashquant_hf.qjl import QJLSketch


def test_estimator_is_unbiased_over_1e5_pairs():
    """Mean estimate over mean true inner product within 1% (pairs correlated so <q, r> stays away from 0)."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**30, ()).item())
    n, d = 100_000, 64
    r = torch.randn(n, d, generator=g)
    q = r + 0.8 * torch.randn(n, d, generator=g)
    sketch = QJLSketch(d, seed=int(torch.randint(0, 1000, ())))
    signs, norms = sketch.encode(r)
    est = sketch.inner_product(q, signs, norms).double()
    true = (q * r).sum(-1).double()
    assert est.mean().item() / true.mean().item() == pytest.approx(1.0, abs=0.01)
    # a wrong scale (e.g. dividing S by sqrt(m), or dropping sqrt(pi/2)) would be off by far more than 1%
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
    # Var = (pi/2) ||r||^2 (||q||^2 - (2/pi) <q, r/||r||>^2) / m; here q is nearly orthogonal to r, ||q||^2 ~ ||r||^2 ~ 64
    expected = math.sqrt(math.pi / 2 / 64) * 64
    assert errors[0] == pytest.approx(expected, rel=0.25)


def test_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 8"):
        QJLSketch(64, m=12)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        QJLSketch(64).encode(torch.randn(3, 32))
