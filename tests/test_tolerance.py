"""The dtype-relative tolerance of the kernel tests (tests/tolerance.py) and the lower-dtype attention they compare
with (attention_helpers.attention_in_dtype)."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import attention_in_dtype
from tolerance import (
    FACTOR,
    approx_exp2_error,
    assert_attention_within_dtype_error,
    assert_within_dtype_error,
    dtype_error_bound,
    max_error,
    ulp_floor,
)


def _matmul_case(gen: torch.Generator, dtype: torch.dtype):
    a = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    b = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    return a @ b, (a.to(dtype) @ b.to(dtype)).double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bound_is_twice_pytorchs_error_in_the_dtype(gen, dtype):
    exact, in_dtype = _matmul_case(gen, dtype)
    torch_error = max_error(in_dtype, exact)
    assert torch_error > 0
    bound = dtype_error_bound(in_dtype, exact, dtype)
    assert bound == max(FACTOR * torch_error, torch.finfo(dtype).eps * exact.abs().max().item())
    assert_within_dtype_error(in_dtype, exact, in_dtype, dtype)  # PyTorch itself passes
    worse = exact.clone()
    worse[3, 5] += 1.01 * bound  # one entry just past the bound fails
    with pytest.raises(AssertionError, match="exceeds"):
        assert_within_dtype_error(worse, exact, in_dtype, dtype)


def test_floor_is_one_ulp_when_pytorch_is_exact(gen):
    exact = torch.randint(-100, 100, (16, 16), generator=gen).double()  # small integers: exact in bf16
    assert max_error(exact.bfloat16(), exact) == 0
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max().item()
    assert ulp_floor(exact, torch.bfloat16) == dtype_error_bound(exact.bfloat16(), exact, torch.bfloat16) == ulp
    assert_within_dtype_error(exact + 0.9 * ulp, exact, exact.bfloat16(), torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_within_dtype_error(exact + 1.1 * ulp, exact, exact.bfloat16(), torch.bfloat16)
    assert_within_dtype_error(exact + 3 * ulp, exact, exact.bfloat16(), torch.bfloat16, floor=4 * ulp)


def test_nan_fails_and_where_restricts(gen):
    exact, in_dtype = _matmul_case(gen, torch.bfloat16)
    poisoned = exact.clone()
    poisoned[0, 0] = float("nan")
    assert max_error(poisoned, exact) == float("inf")
    with pytest.raises(AssertionError):
        assert_within_dtype_error(poisoned, exact, in_dtype, torch.bfloat16)
    rows = torch.ones(exact.shape[0], dtype=torch.bool)
    rows[0] = False
    assert_within_dtype_error(poisoned, exact, in_dtype, torch.bfloat16, where=rows)
    assert max_error(poisoned, exact, where=torch.zeros_like(rows)) == 0.0
    with pytest.raises(ValueError, match=r"`actual` has shape \[48, 31\], `expected` \[48, 32\]"):
        max_error(exact[:, 1:], exact)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_keys", [1, 7, 300])
def test_attention_in_dtype_errs_like_torch_sdpa(gen, dtype, num_keys):
    """The emulation's error against float64 is within 2x of torch SDPA's own in the same dtype (both ways), and
    in float64 it is SDPA in float64."""
    q = torch.randn(2, 8, 5, 64, generator=gen, dtype=torch.float64)
    k = 2 * torch.randn(2, 2, num_keys, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, num_keys, 64, generator=gen, dtype=torch.float64)
    exact, lse = attention_in_dtype(q, k, v, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(exact, sdpa, rtol=1e-12, atol=1e-12)
    scores = q @ k.repeat_interleave(4, dim=1).transpose(-1, -2) * 0.125
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    ours = max_error(attention_in_dtype(q, k, v, 0.125, dtype=dtype)[0], exact)
    sdpa_low = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.125,
                                                                enable_gqa=True)
    theirs = max_error(sdpa_low, exact)
    assert theirs / 2 <= ours <= 2 * theirs, (ours, theirs)


def test_attention_in_dtype_masked_rows_and_bias(gen):
    q = torch.randn(2, 4, 3, 16, generator=gen)
    k = torch.randn(2, 2, 9, 16, generator=gen)
    v = torch.randn(2, 2, 9, 16, generator=gen)
    bias = torch.zeros(2, 1, 1, 9)
    bias[0, ..., :4] = float("-inf")
    bias[1] = float("-inf")
    out, lse = attention_in_dtype(q, k, v, 0.25, bias, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    exact, _ = attention_in_dtype(q[:1], k[:1, :, 4:], v[:1, :, 4:], 0.25)
    assert_within_dtype_error(out[:1], exact, out[:1], torch.bfloat16)
    assert max_error(out[:1], exact) > 0


@pytest.mark.parametrize("q_len", [1, 3, 9, 12])
def test_attention_in_dtype_causal_is_bottom_right_aligned(gen, q_len):
    """Causal attention of the last ``q_len`` positions over 9 keys (the first rows of a longer query see none)."""
    from flashquant_hf.reference.flash_attention import flash_attention

    q = torch.randn(2, 4, q_len, 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 9, 16, generator=gen, dtype=torch.float64)
    out, lse = attention_in_dtype(q, k, v, 0.25, causal=True)
    want_out, want_lse = flash_attention(q, k, v, 0.25, causal=True)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.double(), rtol=1e-6, atol=1e-6)
    assert torch.isinf(lse[:, :, : max(0, q_len - 9)]).all() and torch.isfinite(lse[:, :, max(0, q_len - 9) :]).all()


def test_attention_check_rows_without_keys_and_relative_floor(gen):
    """The attention check wants the exact -inf rows with out 0, and takes a floor relative to each output's
    largest magnitude."""
    out = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    lse = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    out[1, 2], lse[1, 2] = 0, float("-inf")
    exact = (out, lse)
    assert_attention_within_dtype_error(exact, exact, exact, torch.float32)
    moved = (out.clone(), lse.clone())
    moved[1][1, 2] = 0.0  # a row that sees keys in the kernel only
    with pytest.raises(AssertionError, match="-inf differ"):
        assert_attention_within_dtype_error(moved, exact, exact, torch.float32)
    off = out + 1e-6 * out.abs().max()
    off[1, 2] = 0
    with pytest.raises(AssertionError, match="out: max error"):
        assert_attention_within_dtype_error((off, lse), exact, exact, torch.float32)
    assert_attention_within_dtype_error((off, lse), exact, exact, torch.float32, relative_floor=2e-6)
    assert approx_exp2_error(0.0) == 2.0**-22 and approx_exp2_error(32.0) == 2.0**-22 + 2.0**-18
