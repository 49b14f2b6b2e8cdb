"""The exact part of a TurboQuantLayer's decode attention on the GPU (``attention.exact_attention_visible``: torch's
FlashAttention-2 kernel with the GQA group folded into the query rows) against attention as SDPA computes it and
against float64, and a whole decode step (sinks, centred compressed part, window) against float64 attention over
the layer's dequantized K/V."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import attention_in_dtype, causal_mask, float64_attention

from flashquant_hf import TurboQuantConfig, TurboQuantLayer
from flashquant_hf.attention import compressed_attention, exact_attention, exact_attention_visible
from flashquant_hf.masks import mask_to_bias
from flashquant_hf.tags import TAG


def _qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, gen):
    q = torch.randn(batch, q_heads, q_len, head_dim, device="cuda", generator=gen).to(dtype)
    k, v = torch.randn(2, batch, kv_heads, kv_len, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("kv_len", [1, 5, 577])
@pytest.mark.parametrize("q_len", [1, 3])
def test_exact_part_matches_sdpa_arithmetic_and_float64(dtype, head_dim, group, kv_len, q_len, cuda_gen):
    q, k, v = _qkv(2, 2 * group, 2, q_len, kv_len, head_dim, dtype, cuda_gen)
    scale = head_dim**-0.5
    out, lse = exact_attention_visible(q, k, v, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    sdpa_out, sdpa_lse = attention_in_dtype(q, k, v, scale, dtype=dtype)
    exact_out, exact_lse = attention_in_dtype(q, k, v, scale)
    ulp = torch.finfo(dtype).eps
    # one rounding of the output and of the probabilities to `dtype`, as SDPA
    assert (out.double() - exact_out).abs().max().item() < 4 * ulp * v.abs().max().item()
    assert (out.float() - sdpa_out.float()).abs().max().item() < 4 * ulp * v.abs().max().item()
    assert (lse.double() - exact_lse).abs().max().item() < 1e-4 * max(1.0, exact_lse.abs().max().item())
    assert (lse - sdpa_lse).abs().max().item() < 1e-4 * max(1.0, sdpa_lse.abs().max().item())


def test_fp32_exact_part_takes_the_fp32_path(cuda_gen):
    q, k, v = _qkv(2, 8, 2, 1, 100, 128, torch.float32, cuda_gen)
    out, lse = exact_attention_visible(q, k, v, 0.1)
    expected_out, expected_lse = exact_attention(q, k, v, None, 0.1)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize("key_bits, value_bits", [(4, 4), (3, 3), (3, 2), (2, 2)])
@pytest.mark.parametrize("q_heads", [2, 8])
def test_decode_step_matches_float64_over_the_dequantized_cache(key_bits, value_bits, q_heads, cuda_gen):
    """Sinks, a centred compressed part and a window on the kernels (bf16, as a model runs them): one decode step
    against float64 attention over what the layer holds, within bf16's rounding of the query, codes' rotation and
    output."""
    batch, kv_heads, head_dim = 2, 2, 128
    settings = dict(key_bits=key_bits, value_bits=value_bits, sink_tokens=4, residual_length=24, window_block=8,
                    key_centering=True, value_centering=True, backend="cuda")
    layer = TurboQuantLayer(TurboQuantConfig(**settings), layer_idx=0)
    for n in (300, 1):
        k, v = torch.randn(2, batch, kv_heads, n, head_dim, device="cuda", generator=cuda_gen).to(torch.bfloat16)
        out_k, _ = layer.update(k + 0.5, v - 0.25)  # offsets give the centring something to remove
        plan = getattr(out_k, TAG)
    assert layer.num_sink == 4 and layer.num_compressed > 200 and layer.num_window >= 24
    query = torch.randn(batch, q_heads, 1, head_dim, device="cuda", generator=cuda_gen).to(torch.bfloat16)
    keys, values = layer.dequantize(torch.float64)
    total = layer.get_seq_length()
    scale = head_dim**-0.5
    expected = float64_attention(query, keys, values, mask_to_bias(causal_mask(batch, 1, total).cuda(), batch, 1,
                                                                   total), scale)
    got = compressed_attention(plan, query, None, scaling=scale)
    assert got.shape == (batch, 1, q_heads, head_dim) and got.dtype == torch.bfloat16
    rel = ((got.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel
