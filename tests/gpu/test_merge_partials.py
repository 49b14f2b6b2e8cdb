"""GPU tests of the log-sum-exp merge ``merge_partials`` (``kernels/merge_partials.py``) against a float64 merge:
errors within 2x those of PyTorch's fp32 merge (the reference), at least the error of the hardware exp2 the kernel
weights with (tests/tolerance.py)."""

import math

import pytest
import torch
from attention_helpers import merge_float64
from tolerance import approx_exp2_error, assert_attention_within_dtype_error

from flashquant_hf.reference.merge_partials import merge_partials as reference_merge

from .poison import poisoned_allocations

DEV = "cuda"


def check(out, lse, outs, lses):
    """The kernel's merge of ``outs`` [S, ..., D] and ``lses`` [S, ...] against float64, within 2x PyTorch's fp32
    merge or the error of ex2.approx over the spread of the lses."""
    finite = lses[torch.isfinite(lses)].double()
    spread = (finite.max() - finite.min()).item() * math.log2(math.e) if finite.numel() else 0.0
    assert_attention_within_dtype_error((out, lse), merge_float64(outs, lses), reference_merge(outs, lses),
                                        torch.float32, relative_floor=approx_exp2_error(spread))


@pytest.mark.parametrize("splits", [1, 2, 7, 32, 40, 64])  # the kernel takes splits 32 at a time
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_merge_matches_float64(splits, head_dim, cuda_gen):
    from flashquant_hf.kernels.merge_partials import merge_partials

    outs = torch.randn(splits, 3, 5, head_dim, device=DEV, generator=cuda_gen)
    lses = torch.randn(splits, 3, 5, device=DEV, generator=cuda_gen) * 4
    lses[0, 0, 0] = -math.inf  # one empty split, whose row holds garbage
    outs[0, 0, 0] = float("nan")
    lses[:, 1, 2] = -math.inf  # a row where every split is empty
    outs[:, 1, 2] = float("nan")  # whatever an empty split left there must not leak
    out, lse = merge_partials(outs, lses)
    assert out.shape == (3, 5, head_dim) and lse.shape == (3, 5)
    assert lse[1, 2] == -math.inf and torch.all(out[1, 2] == 0)
    check(out, lse, torch.nan_to_num(outs), lses)


def test_merge_non_contiguous_and_half_inputs(cuda_gen):
    from flashquant_hf.kernels.merge_partials import merge_partials

    big = torch.randn(4, 6, 2, 128, device=DEV, dtype=torch.float16, generator=cuda_gen)
    outs = big[:, ::2]  # [4, 3, 2, 128], strided
    lses = torch.randn(2, 3, 4, device=DEV, generator=cuda_gen).permute(2, 1, 0)  # [4, 3, 2], permuted
    out, lse = merge_partials(outs, lses)
    check(out, lse, outs.float(), lses)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_merge_of_prefill_partials(head_dim, splits, cuda_gen):
    """The launch on the prefill's partials ([S, B, Hq, Lq, D] flattened to rows): empty splits (-inf), a row no
    split saw; outputs poisoned first."""
    from flashquant_hf.kernels import merge_partials

    shape = (splits, 2, 3, 37)
    parts = torch.randn(*shape, head_dim, generator=cuda_gen, device=DEV)
    lses = 5 * torch.randn(*shape, generator=cuda_gen, device=DEV)
    empty = torch.rand(*shape, generator=cuda_gen, device=DEV) < 0.3
    lses[empty] = -math.inf
    parts[empty] = 0.0  # what the kernel writes for a split that saw no key
    lses[:, 1, 2, 5] = -math.inf
    parts[:, 1, 2, 5] = 0.0
    out = torch.full(shape[1:] + (head_dim,), float("nan"), device=DEV)
    lse = torch.full(shape[1:], float("nan"), device=DEV)
    merge_partials.launch_merge(parts.view(splits, -1, head_dim), lses.view(splits, -1), out.view(-1, head_dim),
                                lse.view(-1))
    assert lse[1, 2, 5] == -math.inf and torch.all(out[1, 2, 5] == 0)
    check(out, lse, parts, lses)


def test_merge_writes_every_output(cuda_gen):
    from flashquant_hf.kernels.merge_partials import merge_partials

    outs = torch.randn(3, 37, 128, device=DEV, generator=cuda_gen)
    lses = torch.randn(3, 37, device=DEV, generator=cuda_gen)
    with poisoned_allocations():
        out, lse = merge_partials(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_merge_validation():
    from flashquant_hf.kernels.merge_partials import merge_partials

    with pytest.raises(ValueError, match="must have shape"):
        merge_partials(torch.zeros(2, 3, 8, device=DEV), torch.zeros(2, 4, device=DEV))
    with pytest.raises(ValueError, match="CUDA"):
        merge_partials(torch.zeros(2, 3, 8), torch.zeros(2, 3))
