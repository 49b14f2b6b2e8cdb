"""The reference attention in rotated space equals float64 dense attention over the decompressed K/V."""

import math

import pytest
import torch

from flashquant_hf import TurboQuantizer
from flashquant_hf.reference.merge_partials import merge_partials
from flashquant_hf.reference.tq_attention import tq_attention


def _dense_attention_f64(q, k, v, scale, causal, key_bias=None):
    """Plain softmax attention in float64 with bottom-right causal alignment and GQA by head repetition."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    lq, n = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(lq)[:, None]
        j = torch.arange(n)[None, :]
        s = s.masked_fill(j > n - lq + i, float("-inf"))
    if key_bias is not None:
        s = s + key_bias.double()[:, None, None, :]
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def _compressed_case(gen, batch, q_heads, kv_heads, q_len, kv_len, head_dim, bits=4):
    kq = TurboQuantizer(head_dim, bits, seed=int(torch.randint(0, 999, (), generator=gen)))
    vq = TurboQuantizer(head_dim, bits, seed=int(torch.randint(1000, 1999, (), generator=gen)))
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen)
    kc, vc = kq.compress(k), vq.compress(v)
    return q, kq, vq, kc, vc


def _run(q, kq, vq, kc, vc, scale, causal, key_bias=None):
    q_rot = q @ kq.rotation().T
    out_rot, lse = tq_attention(
        q_rot, kc.indices, kc.norms, vc.indices, vc.norms, kq.centroids(), vq.centroids(),
        kq.bits, vq.bits, scale, causal=causal, key_bias=key_bias,
    )
    return out_rot @ vq.rotation(), lse


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("q_len,kv_len,causal", [(1, 37, False), (13, 13, True), (5, 40, True), (9, 23, False)])
@pytest.mark.parametrize("bits", [2, 4])
def test_matches_dense_attention_over_decompressed_kv(q_heads, kv_heads, q_len, kv_len, causal, bits, gen):
    q, kq, vq, kc, vc = _compressed_case(gen, 2, q_heads, kv_heads, q_len, kv_len, 64, bits)
    scale = 1 / math.sqrt(64)
    out, lse = _run(q, kq, vq, kc, vc, scale, causal)
    keys, values = kq.decompress(kc, torch.float64), vq.decompress(vc, torch.float64)
    ref, ref_lse = _dense_attention_f64(q, keys, values, scale, causal)
    assert _rel(out, ref) < 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_key_bias_masks_padding_and_fully_masked_rows_are_zero(gen):
    q, kq, vq, kc, vc = _compressed_case(gen, 2, 4, 2, 3, 11, 64)
    bias = torch.zeros(2, 11)
    bias[0, :4] = float("-inf")  # left padding of sequence 0
    bias[1, :] = float("-inf")  # sequence 1 sees nothing
    out, lse = _run(q, kq, vq, kc, vc, 0.125, False, key_bias=bias)
    keys, values = kq.decompress(kc, torch.float64)[:1], vq.decompress(vc, torch.float64)[:1]
    ref, ref_lse = _dense_attention_f64(q[:1], keys, values, 0.125, False, bias[:1])
    assert _rel(out[:1], ref) < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all() and not out.isnan().any()


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16])
def test_merge_partials_equals_unsplit(splits, gen):
    """Partial attentions over disjoint key ranges (some empty) merge to the full result."""
    q, kq, vq, kc, vc = _compressed_case(gen, 2, 8, 2, 1, 50, 64)
    full, full_lse = _run(q, kq, vq, kc, vc, 0.125, False)
    # A repeated cut makes an empty split.
    cuts = sorted(torch.randint(0, 51, (splits - 1,), generator=gen).tolist() + [0, 0, 50])
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        sl = slice(a, b)
        part = (kc.indices[:, :, sl], kc.norms[:, :, sl], vc.indices[:, :, sl], vc.norms[:, :, sl])
        out_rot, lse = tq_attention(q @ kq.rotation().T, *part, kq.centroids(), vq.centroids(), 4, 4, 0.125)
        outs.append(out_rot)
        lses.append(lse)
    merged, merged_lse = merge_partials(torch.stack(outs), torch.stack(lses))
    assert _rel(merged @ vq.rotation(), full) < 1e-5
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-5)


def test_merge_of_only_empty_splits_is_zero_with_neg_inf_lse(gen):
    out, lse = merge_partials(torch.randn(3, 2, 8, generator=gen), torch.full((3, 2), float("-inf")))
    assert torch.equal(out, torch.zeros(2, 8)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("op,function", [
    ("tq_attention", "tq_attention"),
    ("tq_decode", "tq_decode"),
    ("tq_prefill", "tq_prefill"),
    ("paged_decode", "paged_decode"),
    ("decode_merged", "decode_merged"),
    ("merge_partials", "merge_partials"),
    ("flash_attention", "flash_attention"),
    ("compress", "compress"),
    ("compress", "compress_into"),
    ("decompress", "decompress"),
])
def test_every_kernel_op_has_a_reference_of_the_same_name_and_signature(op, function):
    """kernels/<op>.py and reference/<op>.py define the same function with the same parameters and defaults."""
    import importlib
    import inspect

    kernel = getattr(importlib.import_module(f"flashquant_hf.kernels.{op}"), function)
    reference = getattr(importlib.import_module(f"flashquant_hf.reference.{op}"), function)
    params = [(p.name, p.kind, p.default) for p in inspect.signature(kernel).parameters.values()]
    assert params == [(p.name, p.kind, p.default) for p in inspect.signature(reference).parameters.values()]


def test_reference_tq_decode_takes_one_query_token(gen):
    """The reference tq_decode keeps the CUDA decode's contract (Lq == 1) and equals tq_attention there."""
    from flashquant_hf.reference.tq_decode import tq_decode

    q, kq, vq, kc, vc = _compressed_case(gen, 2, 4, 2, 1, 30, 64)
    args = (kc.indices, kc.norms, vc.indices, vc.norms, kq.centroids(), vq.centroids(), 4, 4, 0.125)
    q_rot = q @ kq.rotation().T
    out, lse = tq_decode(q_rot, *args)
    want_out, want_lse = tq_attention(q_rot, *args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="one query token"):
        tq_decode(torch.cat([q_rot, q_rot], dim=2), *args)
