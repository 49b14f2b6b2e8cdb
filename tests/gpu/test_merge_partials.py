"""GPU tests of the log-sum-exp merge ``merge_partials`` (``kernels/merge_partials.py``) against a float64 merge."""

import math

import pytest
import torch

DEV = "cuda"


def reference64(outs, lses):
    """Independent float64 merge: softmax weights over splits (a row with every split empty -> out 0, lse -inf)."""
    lses = lses.double()
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(0))
    weights = torch.where(torch.isfinite(lses), weights, 0)
    out = (weights.unsqueeze(-1) * torch.nan_to_num(outs.double())).sum(0)
    return out, lse


@pytest.mark.parametrize("splits", [1, 2, 7, 32, 40, 64])  # the kernel takes splits 32 at a time
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_merge_matches_float64(splits, head_dim):
    from flashquant_hf.kernels.merge_partials import merge_partials

    outs = torch.randn(splits, 3, 5, head_dim, device=DEV)
    lses = torch.randn(splits, 3, 5, device=DEV) * 4
    lses[0, 0, 0] = -math.inf  # one empty split, whose row holds garbage
    outs[0, 0, 0] = float("nan")
    lses[:, 1, 2] = -math.inf  # a row where every split is empty
    outs[:, 1, 2] = float("nan")  # whatever an empty split left there must not leak
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = reference64(outs, lses)
    assert out.shape == (3, 5, head_dim) and lse.shape == (3, 5)
    assert lse[1, 2] == -math.inf and torch.all(out[1, 2] == 0)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_merge_non_contiguous_and_half_inputs():
    from flashquant_hf.kernels.merge_partials import merge_partials

    big = torch.randn(4, 6, 2, 128, device=DEV, dtype=torch.float16)
    outs = big[:, ::2]  # [4, 3, 2, 128], strided
    lses = torch.randn(2, 3, 4, device=DEV).permute(2, 1, 0)  # [4, 3, 2], permuted
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = reference64(outs.float(), lses)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_writes_every_output(monkeypatch, poison):
    from flashquant_hf.kernels.merge_partials import merge_partials

    outs = torch.randn(3, 37, 128, device=DEV)
    lses = torch.randn(3, 37, device=DEV)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    out, lse = merge_partials(outs, lses)
    monkeypatch.undo()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_merge_validation():
    from flashquant_hf.kernels.merge_partials import merge_partials

    with pytest.raises(ValueError, match="must have shape"):
        merge_partials(torch.randn(2, 3, 8, device=DEV), torch.randn(2, 4, device=DEV))
    with pytest.raises(ValueError, match="CUDA"):
        merge_partials(torch.randn(2, 3, 8), torch.randn(2, 3))
