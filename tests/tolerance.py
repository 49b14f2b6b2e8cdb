"""Dtype-relative tolerances for the kernel tests (flash-attention's rule).

A kernel's largest error against float64 may be at most ``FACTOR`` times the largest error of the same math done by
PyTorch in the dtype the kernel computes in, and never needs to be smaller than one unit in the last place of that
dtype at the result's largest magnitude (the floor: PyTorch's own error can be zero by luck, e.g. for one key).

>>> a, b = torch.randn(64, 64, dtype=torch.float64), torch.randn(64, 64, dtype=torch.float64)
>>> in_bf16 = (a.bfloat16() @ b.bfloat16()).double()
>>> assert_within_dtype_error(kernel(a, b), a @ b, in_bf16, torch.bfloat16)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

FACTOR = 2.0


def max_error(actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """Largest ``|actual - expected|`` in float64 over ``where`` (default: every entry); inf where ``actual`` is
    not finite (a NaN left by an unwritten output must fail, not vanish from a max)."""
    if actual.shape != expected.shape:
        raise ValueError(f"`actual` has shape {list(actual.shape)}, `expected` {list(expected.shape)}")
    diff = (actual.double() - expected.double()).abs()
    if where is not None:
        diff = diff[where]
    if diff.numel() == 0:
        return 0.0
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def largest(expected: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """The largest finite ``|expected|`` (over ``where``; 0 if there is none)."""
    values = expected.double().abs()
    if where is not None:
        values = values[where]
    values = values[torch.isfinite(values)]
    return float(values.max()) if values.numel() else 0.0


def ulp_floor(expected: torch.Tensor, dtype: torch.dtype, where: torch.Tensor | None = None) -> float:
    """One unit in the last place of ``dtype`` at the largest finite ``|expected|`` (over ``where``)."""
    return torch.finfo(dtype).eps * largest(expected, where)


def dtype_error_bound(torch_result: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype,
                      where: torch.Tensor | None = None, floor: float | None = None) -> float:
    """``FACTOR`` x PyTorch's largest error in ``dtype`` against ``exact``, at least ``floor`` (default: one ulp of
    ``dtype`` at the largest ``|exact|``)."""
    floor = ulp_floor(exact, dtype, where) if floor is None else floor
    return max(FACTOR * max_error(torch_result, exact, where), floor)


def assert_within_dtype_error(actual: torch.Tensor, exact: torch.Tensor, torch_result: torch.Tensor,
                              dtype: torch.dtype, what: str = "output", where: torch.Tensor | None = None,
                              floor: float | None = None) -> float:
    """Assert ``max_error(actual, exact) <= dtype_error_bound(torch_result, exact, dtype)``; returns the error.

    ``torch_result`` is the same math evaluated by PyTorch in ``dtype``; ``exact`` the float64 result.
    """
    error = max_error(actual, exact, where)
    bound = dtype_error_bound(torch_result, exact, dtype, where, floor)
    print(f"{what}: max error {error:.3e}, bound {bound:.3e} ({FACTOR:g} x PyTorch in {dtype}, floor included)")
    assert error <= bound, (f"{what}: max error {error:.3e} against float64 exceeds {bound:.3e}, {FACTOR:g} x the "
                            f"error of PyTorch computing the same in {dtype}")
    return error


def approx_exp2_error(exponent_spread: float) -> float:
    """Relative error of a weight ``2^x`` taken with ``ex2.approx.f32`` (2 ulp: 2^-22, PTX ISA) from an fp32
    exponent of magnitude up to ``exponent_spread``, rounded twice (the difference to the maximum and the product with
    log2 e: half an ulp each). The floor of kernels that weight with the hardware exp2, where PyTorch's exp is
    correctly rounded."""
    return 2.0**-22 + exponent_spread * 2.0**-23


def assert_attention_within_dtype_error(result, exact, in_dtype, dtype: torch.dtype, label: str = "",
                                        relative_floor: float | None = None, lse_floor: float | None = None) -> None:
    """A kernel's attention ``result`` (out, lse) against the float64 ``exact`` (out, lse) and PyTorch's ``in_dtype``
    (out, lse) computed in ``dtype``: out finite; the same rows see no key (lse -inf, out 0); out and lse within
    the dtype bound (lse over the rows that see keys). ``relative_floor``: the floor as a fraction of the largest
    magnitude (default: one ulp of ``dtype``); ``lse_floor`` replaces it for lse.

    out: shape [..., D]; lse: shape [...] (the leading shapes agree).
    """
    (out, lse), (exact_out, exact_lse), (torch_out, torch_lse) = result, exact, in_dtype
    assert torch.isfinite(out).all(), f"{label}: NaN/Inf in out"
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{label}: the rows of lse that are -inf differ"
    assert torch.all(lse[~seen] == float("-inf")) and torch.all(out[~seen] == 0), f"{label}: rows without keys"
    out_floor = None if relative_floor is None else relative_floor * largest(exact_out)
    if lse_floor is None and relative_floor is not None:
        lse_floor = relative_floor * largest(exact_lse, seen)
    assert_within_dtype_error(out, exact_out, torch_out, dtype, f"{label} out", floor=out_floor)
    assert_within_dtype_error(lse, exact_lse, torch_lse, dtype, f"{label} lse", where=seen, floor=lse_floor)


def score_rounding_floor(q: torch.Tensor, keys: torch.Tensor, scale: float, dtype: torch.dtype) -> float:
    """One ulp of ``dtype`` at the largest ``scale * sum_i |q_i k_i|``: what rounding the keys (or the
    queries) to ``dtype`` may move a score by, whichever way a kernel rounds them. A bound for the lse when PyTorch's
    own error is a single sample (one key, one row)."""
    magnitude = (q.double().abs() @ keys.double().abs().transpose(-1, -2)) * scale
    return torch.finfo(dtype).eps * float(magnitude.max())
