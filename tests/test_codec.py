"""Split codes (outlier channels, QJL key residual): layout, channel choice, error, unbiasedness, and the cache's
attention over them against float64 attention over the decoded K/V."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import causal_mask, float64_attention
from hf_helpers import one_thread

from flashquant_hf import TurboQuantCache, TurboQuantConfig, TurboQuantLayer
from flashquant_hf.attention import compressed_attention
from flashquant_hf.codec import HeadCodec
from flashquant_hf.masks import mask_to_bias
from flashquant_hf.packing import packed_size
from flashquant_hf.quantizer import CompressedTensor
from flashquant_hf.reference.compress import compress as reference_compress
from flashquant_hf.tags import TAG, CompressedPlan

B, H, D = 2, 2, 16


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _compress(tq, x):
    dev = x.device
    return reference_compress(x, tq.rotation(dev), tq.boundaries(dev), tq.bits, tq.centroids(dev), tq.norm_correction)


def _codec(head_dim=D, bits=3, outliers=0, qjl=False, norm_correction=True, seed=0):
    return HeadCodec(head_dim, bits, seed, "haar", norm_correction, outlier_channels=outliers, qjl=qjl)


def _code(codec, x):
    order = codec.channel_order(x)
    return codec.encode(x, order, _compress), order


def test_plain_code_is_the_quantizer_code(gen):
    codec = _codec(bits=4)
    x = torch.randn(B, H, 9, D, generator=gen)
    tensors, order = _code(codec, x)
    assert codec.is_plain and order is None and codec.tensor_count == 2
    expected = codec.quantizer.compress_tensors(x)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_plain_code_decodes_like_the_quantizer(gen):
    codec = _codec(bits=3)
    x = torch.randn(B, H, 9, D, generator=gen)
    tensors, order = _code(codec, x)
    expected = codec.quantizer.decompress(CompressedTensor(*tensors, x.shape, torch.float32, 3))
    torch.testing.assert_close(codec.decode(tensors, order), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("outliers, qjl", [(4, False), (0, True), (6, True)])
def test_split_code_layout_spends_the_bits_it_promises(outliers, qjl, gen):
    bits = 3
    codec = _codec(bits=bits, outliers=outliers, qjl=qjl)
    tensors, _ = _code(codec, torch.randn(B, H, 5, D, generator=gen))
    assert len(tensors) == codec.tensor_count and not codec.is_plain
    code_bits = bits - 1 if qjl else bits
    widths = [(outliers, code_bits + 1), (D - outliers, code_bits)] if outliers else [(D, code_bits)]
    for i, (size, part_bits) in enumerate(widths):
        assert tensors[2 * i].shape == (B, H, 5, packed_size(size, part_bits)) and tensors[2 * i].dtype == torch.uint8
        assert tensors[2 * i + 1].shape == (B, H, 5) and tensors[2 * i + 1].dtype == torch.float32
    if qjl:
        assert tensors[-2].shape == (B, H, 5, D // 8) and tensors[-1].shape == (B, H, 5)
    # bits per coordinate on average: `bits`, plus one per outlier channel (up to byte padding of each part)
    index_bits = sum(t.shape[-1] * 8 for t in tensors if t.dtype == torch.uint8)
    assert D * bits + outliers <= index_bits < D * bits + outliers + 8 * len(widths)


def test_outlier_channels_are_the_largest_mean_square_per_head(gen):
    codec = _codec(outliers=4)
    x = torch.randn(B, H, 200, D, generator=gen)
    heavy = [[torch.randperm(D, generator=gen)[:4] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            x[b, h, :, heavy[b][h]] *= torch.tensor([16.0, 8.0, 4.0, 2.0])
    order = codec.channel_order(x)
    for b in range(B):
        for h in range(H):
            assert order[b, h, :4].tolist() == heavy[b][h].tolist()  # descending mean square
            rest = order[b, h, 4:]
            assert torch.equal(rest, rest.sort().values) and sorted(order[b, h].tolist()) == list(range(D))


def test_outlier_channels_cut_the_error_of_heavy_channels(gen):
    """Vectors with 8 heavy channels of 64: the split code (2 bits, 8 channels at 3) beats the plain 2-bit code."""
    head_dim = 64
    x = torch.randn(1, 4, 400, head_dim, generator=gen)
    x[..., 10:18] *= 6.0
    errors = {}
    for outliers in (0, 8):
        codec = _codec(head_dim=head_dim, bits=2, outliers=outliers)
        tensors, order = _code(codec, x)
        errors[outliers] = ((codec.decode(tensors, order) - x).norm() / x.norm()).item()
    assert errors[8] < 0.75 * errors[0], errors


@pytest.mark.parametrize("outliers, qjl", [(0, False), (4, False), (0, True), (4, True)])
def test_dot_and_weighted_sum_equal_products_with_the_decoded_vectors(outliers, qjl, gen):
    codec = _codec(bits=3, outliers=outliers, qjl=qjl)
    x = torch.randn(B, H, 13, D, generator=gen)
    tensors, order = _code(codec, x)
    decoded = codec.decode(tensors, order).double()
    q = torch.randn(B, H, 5, D, generator=gen)
    p = torch.rand(B, H, 5, 13, generator=gen)
    assert torch.allclose(codec.dot(q, tensors, order).double(), q.double() @ decoded.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(codec.weighted_sum(p, tensors, order).double(), p.double() @ decoded, atol=1e-4)


def test_qjl_scores_are_unbiased_where_the_mse_code_shrinks_them(gen):
    """Over 10^5 (query, key) pairs per seed the QJL score's slope against the true one is 1 within 1% (mean of
    3 seeds); the 2-bit MSE code without norm correction (what QJL spends its first bits on) shrinks scores by
    ~11%, so the test can fail. (A sketch drawn from the rotation's random stream gave 0.99.)"""
    head_dim, keys, queries = 64, 2000, 50
    x = torch.randn(1, 1, keys, head_dim, generator=gen)
    q = torch.randn(1, 1, queries, head_dim, generator=gen)
    true = (q.double() @ x.double().transpose(-1, -2)).flatten()
    slopes = {"qjl": 0.0, "mse": 0.0}
    for seed in range(3):
        for name, codec in (
            ("qjl", _codec(head_dim=head_dim, bits=3, qjl=True, norm_correction=False, seed=seed)),
            ("mse", _codec(head_dim=head_dim, bits=2, norm_correction=False, seed=seed)),
        ):
            tensors, order = _code(codec, x)
            est = codec.dot(q, tensors, order).double().flatten()
            slopes[name] += ((est * true).sum() / (true * true).sum()).item() / 3
    assert abs(slopes["qjl"] - 1) < 0.01, slopes
    assert slopes["mse"] < 0.95, slopes


# --------------------------------------------------------------------------------------------- in the cache
def _layer(**overrides) -> TurboQuantLayer:
    return TurboQuantLayer(TurboQuantConfig(backend="torch", **{"window_block": 1, **overrides}), layer_idx=0)


def _kv(length, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, length, D, generator=gen), torch.randn(B, H, length, D, generator=gen)


def _feed(layer, chunks, seed=0):
    out = None
    for i, n in enumerate(chunks):
        out = layer.update(*_kv(n, seed + i))
        plan = getattr(out[0], TAG, None)
        if isinstance(plan, CompressedPlan) and i < len(chunks) - 1:
            layer.consume_plan(plan)
    return getattr(out[0], TAG)


LEVERS = {
    "outliers": dict(bits=3, outlier_channels=4),
    "qjl": dict(bits=4, key_qjl=True),
    "both": dict(key_bits=4, value_bits=2, outlier_channels=6, key_qjl=True),
}


@pytest.mark.parametrize("levers", sorted(LEVERS))
@pytest.mark.parametrize(
    "residual, sinks, chunks, q_len, centring",
    # the last: a 70-row chunk, more than one block of the torch path's rows
    [(0, 0, [9, 1], 1, False), (3, 2, [9, 6], 6, True), (8, 1, [12, 3], 3, True), (4, 0, [9, 70], 70, True)],
)
@pytest.mark.parametrize("padding", [False, True])
def test_attention_over_split_codes_matches_float64_over_decoded_kv(levers, residual, sinks, chunks, q_len, centring,
                                                                      padding, gen):
    layer = _layer(residual_length=residual, sink_tokens=sinks, key_centering=centring, value_centering=centring,
                   **LEVERS[levers])
    plan = _feed(layer, chunks[:-1] + [q_len], seed=3)
    assert not layer.is_plain and layer.num_compressed > 0
    total = layer.get_seq_length()
    query = torch.randn(B, 6, q_len, D, generator=gen)
    mask = causal_mask(B, q_len, total, pad=[0, 2] if padding else None)
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query, keys, values, mask_to_bias(mask, B, q_len, total), 0.3)
    got = compressed_attention(plan, query, mask if padding else None, scaling=0.3)
    assert (got.double() - expected).abs().max().item() < 2e-5


def test_split_code_dequantize_is_close_and_counts_its_bytes():
    layer = _layer(residual_length=0, sink_tokens=0, key_centering=False, value_centering=False, bits=3,
                   outlier_channels=4, key_qjl=True)
    _feed(layer, [40, 1])
    keys, values = _kv(40, 0)
    k_hat, v_hat = layer.dequantize()
    # QJL trades variance for bias: its keys are noisier than the values' plain 3-bit code
    for exact, approx, bound in ((keys, k_hat[:, :, :40], 0.7), (values, v_hat[:, :, :40], 0.3)):
        assert ((approx - exact).norm() / exact.norm()).item() < bound
    per_token = B * H * (packed_size(4, 3) + packed_size(12, 2) + 8 + D // 8 + 4)  # keys: 2-bit MSE + outliers + QJL
    per_token += B * H * (packed_size(4, 4) + packed_size(12, 3) + 8)  # values: 3 bits + outliers at 4
    assert layer.store.nbytes == layer.store.capacity * per_token
    orders = 2 * B * H * D * 8
    assert layer.nbytes == layer.store.nbytes + orders


def test_beam_reorder_moves_the_channel_orders_with_the_rows():
    layer = _layer(residual_length=0, bits=3, outlier_channels=4)
    _feed(layer, [20, 1])
    before_k, before_v = layer.dequantize()
    index = torch.tensor([1, 0])
    layer.reorder_cache(index)
    after_k, after_v = layer.dequantize()
    assert torch.equal(after_k, before_k[index]) and torch.equal(after_v, before_v[index])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(bits=4, outlier_channels=4), "key_bits"),
        (dict(key_bits=3, value_bits=4, outlier_channels=4), "value_bits"),
        (dict(bits=1, key_qjl=True), "key_bits"),
        (dict(bits=3, outlier_channels=-2), "outlier_channels"),
    ],
)
def test_invalid_lever_settings_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantConfig(**overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(bits=3, outlier_channels=5), "even number from 4 to head_dim - 4 = 12"),
        (dict(bits=3, outlier_channels=14), "even number"),
        (dict(bits=3, outlier_channels=6, rotation="hadamard"), "power-of-two parts"),
    ],
)
def test_lever_that_does_not_fit_the_head_dim_raises_and_leaves_the_cache_unchanged(overrides, match):
    cache = TurboQuantCache(**overrides)
    with pytest.raises(ValueError, match=match):
        cache.update(*_kv(5, 0), layer_idx=0)
    assert len(cache.layers) == 0 and cache.get_seq_length() == 0


def test_cuda_backend_with_cpu_tensors_raises_before_storing_anything():
    cache = TurboQuantCache(backend="cuda", bits=3, outlier_channels=4)
    with pytest.raises(RuntimeError, match="backend='cuda'"):
        cache.update(*_kv(5, 0), layer_idx=0)
    assert len(cache.layers) == 0 and cache.get_seq_length() == 0
