"""TurboQuantLayer / TurboQuantCache on synthetic tensors: storage, cache operations, the compressed attention
against float64 attention over the dequantized K/V, and bad input."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import causal_mask, float64_attention
from hf_helpers import one_thread

from flashquant_hf import TurboQuantCache, TurboQuantConfig, TurboQuantLayer
from flashquant_hf.attention import compressed_attention
from flashquant_hf.codec import quantizer
from flashquant_hf.masks import mask_to_bias
from flashquant_hf.registration import install, uninstall
from flashquant_hf.tags import TAG, CompressedPlan, FirstPrefillTag

B, H, D = 2, 2, 16


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _kv(length: int, batch: int = B, heads: int = H, dim: int = D, dtype=torch.float32, seed: int | None = None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return (
        torch.randn(batch, heads, length, dim, generator=gen).to(dtype),
        torch.randn(batch, heads, length, dim, generator=gen).to(dtype),
    )


def _layer(**overrides) -> TurboQuantLayer:
    # Storage tests reason about token counts and bit-exact codes: no default sinks / centring / window blocks
    # unless asked for.
    overrides = {"sink_tokens": 0, "key_centering": False, "value_centering": False, "window_block": 1, **overrides}
    return TurboQuantLayer(TurboQuantConfig(backend="torch", **overrides), layer_idx=0)


def _fill(layer: TurboQuantLayer, chunks: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed chunks of random K/V; returns everything fed, concatenated ([B, H, sum, D])."""
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k, v = _kv(n, seed=seed + i)
        out = layer.update(k, v)
        plan = getattr(out[0], TAG, None)
        if isinstance(plan, CompressedPlan):
            layer.consume_plan(plan)  # no attention runs in these storage tests
        ks.append(k)
        vs.append(v)
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _snapshot(layer: TurboQuantLayer):
    tensors = [t.clone() for buf in (layer.sinks, layer.store, layer.window) for t in buf.views()]
    means = [None if m is None else m.clone() for m in (layer.key_mean, layer.value_mean)]
    return (layer.num_sink, layer.num_compressed, layer.num_window, layer.is_initialized, tensors, means)


def _same(a, b) -> bool:
    if a[:4] != b[:4] or len(a[4]) != len(b[4]):
        return False
    if not all(torch.equal(x, y) for x, y in zip(a[4], b[4])):
        return False
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[5], b[5]))


# --------------------------------------------------------------------------------------------- storage
@pytest.mark.parametrize(
    "residual, sinks, chunks, expected",
    [
        (4, 0, [10], (0, 6, 4)),
        (4, 0, [10, 1, 1], (0, 8, 4)),
        (0, 0, [7, 1, 3], (0, 11, 0)),
        (128, 0, [97, 1], (0, 0, 98)),
        (3, 2, [1, 1, 6], (2, 3, 3)),  # the first two tokens fill the sinks
        (5, 4, [2, 9], (4, 2, 5)),
    ],
)
def test_tokens_go_to_sinks_then_window_then_store(residual, sinks, chunks, expected):
    """Layout ``[sinks | compressed | window]``; e.g. R=4, 10 tokens: tokens 0-5 compressed, 6-9 exact."""
    layer = _layer(residual_length=residual, sink_tokens=sinks)
    keys, values = _fill(layer, chunks)
    assert (layer.num_sink, layer.num_compressed, layer.num_window) == expected
    assert layer.get_seq_length() == sum(chunks)
    n_sink, n_comp, _ = expected
    if n_sink:
        sk, sv = layer.sink_states()
        assert torch.equal(sk, keys[:, :, :n_sink]) and torch.equal(sv, values[:, :, :n_sink])
    if layer.num_window:
        wk, wv = layer.window.views()
        assert torch.equal(wk, keys[:, :, n_sink + n_comp :]) and torch.equal(wv, values[:, :, n_sink + n_comp :])
    # The store holds exactly what the quantizer makes of those tokens, bit for bit.
    if not n_comp:
        return
    cfg = layer.config
    tq_k = quantizer(D, cfg.key_bits, cfg.key_seed, cfg.rotation, cfg.norm_correction)
    kp, kn, vp, vn = layer.compressed_views()
    ref = tq_k.compress(keys[:, :, n_sink : n_sink + n_comp])
    assert torch.equal(kp, ref.indices) and torch.allclose(kn, ref.norms, rtol=1e-6, atol=0)


def test_store_grows_in_blocks_of_32_tokens():
    layer = _layer(residual_length=0)
    _fill(layer, [5])
    capacities = [layer.store.capacity]
    for step in range(600):
        _fill(layer, [1], seed=100 + step)
        if layer.store.capacity != capacities[-1]:
            capacities.append(layer.store.capacity)
    assert layer.num_compressed == 605
    assert capacities == list(range(32, 608 + 1, 32))  # one growth per 32 tokens, never more than 31 spare


def test_first_allocation_is_the_prefill_rounded_up_to_a_block():
    layer = _layer(residual_length=0)
    _fill(layer, [1000])
    assert layer.store.capacity == 1024


def test_exact_window_is_allocated_as_it_fills():
    layer = _layer(residual_length=128, window_block=64)
    _fill(layer, [5, 1, 1])
    assert layer.window.capacity == 7
    _fill(layer, [300], seed=9)  # the window keeps 128 + (307 - 128) % 64 tokens, at most 128 + 63
    assert layer.num_window == 179 and layer.window.capacity == 179
    _fill(layer, [1] * 13, seed=10)  # 191 exact tokens, then a block of 64 leaves: the capacity stays the most held
    assert layer.num_window == 128 and layer.window.capacity == 191


def test_window_block_compresses_whole_blocks():
    """window_block=4, window 3: the window fills to 6 exact tokens, then the 4 oldest are compressed at once."""
    layer = _layer(residual_length=3, window_block=4)
    counts = []
    for n in [5] + [1] * 10:
        _fill(layer, [n], seed=n + len(counts))
        counts.append((layer.num_compressed, layer.num_window))
    assert counts[0] == (0, 5)
    assert [c for c, _ in counts] == [0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12]
    assert all(3 <= w <= 6 for _, w in counts[1:]) and layer.window.capacity <= 6 + 64
    with pytest.raises(ValueError, match="window_block"):
        TurboQuantConfig(window_block=0)


def test_attention_with_window_blocks_matches_float64_over_dequantized_kv(gen):
    layer = _layer(residual_length=2, window_block=3, sink_tokens=1, key_centering=True)
    _fill(layer, [9, 1, 1])
    out_k, _ = layer.update(*_kv(1, seed=50))
    plan = getattr(out_k, TAG)
    assert layer.num_compressed == 9 and layer.num_window == 2  # 1 sink + 8 (6 compressed), 1, 1, then 3 at once
    query = torch.randn(B, 4, 1, D, generator=gen)
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query, keys, values, None, 0.3)
    assert (compressed_attention(plan, query, None, scaling=0.3).double() - expected).abs().max().item() < 2e-5


def test_window_buffer_stays_bounded():
    layer = _layer(residual_length=16)
    _fill(layer, [3] + [1] * 300)
    assert layer.num_window == 16
    assert layer.window.capacity <= 16 + 64


def test_nbytes_counts_every_tensor():
    layer = _layer(residual_length=4, sink_tokens=2, key_centering=True, value_centering=True)
    _fill(layer, [300])
    buffers = (layer.sinks, layer.store, layer.window)
    expected = sum(t.numel() * t.element_size() for buf in buffers for t in buf.tensors)
    expected += 2 * B * H * D * 4  # the two fp32 means
    assert layer.nbytes == expected
    per_token_compressed = H * B * 2 * (D * 4 // 8 + 4)
    assert layer.store.nbytes == layer.store.capacity * per_token_compressed


@pytest.mark.parametrize(
    "bits, head_dim, minimum",
    [(4, 128, 3.4), (4, 64, 3.2), (3, 128, 4.4), (2.5, 128, 5.5)],
)
def test_cache_wide_compression_at_32k_tokens(bits, head_dim, minimum, gen):
    """The presets' promised ratios (quality issue): every allocated byte against bf16 K/V of the same tokens."""
    layer = TurboQuantLayer(TurboQuantConfig(bits=bits), layer_idx=0)
    tokens = 32 * 1024
    keys = torch.randn(1, 1, tokens, head_dim, dtype=torch.bfloat16, generator=gen)
    values = torch.randn(1, 1, tokens, head_dim, dtype=torch.bfloat16, generator=gen)
    layer.update(keys, values)
    layer.update(keys[:, :, :1], values[:, :, :1])  # one decode step: the window is full from here on
    bf16_bytes = 2 * (tokens + 1) * head_dim * 2
    assert layer.nbytes * minimum <= bf16_bytes, f"{bf16_bytes / layer.nbytes:.3f}x < {minimum}x"


def test_dequantize_reconstructs_the_sequence():
    layer = _layer(residual_length=3, sink_tokens=1, key_centering=True)
    keys, values = _fill(layer, [40, 1, 1])
    k_hat, v_hat = layer.dequantize()
    assert k_hat.shape == keys.shape
    rel = (k_hat - keys).norm() / keys.norm()
    assert rel < 0.15  # TQ4 on Gaussian vectors: ~0.1 relative error
    assert torch.equal(k_hat[:, :, :1], keys[:, :, :1]) and torch.equal(v_hat[:, :, -3:], values[:, :, -3:])


def test_update_returns_exact_states_while_nothing_is_compressed():
    layer = _layer(residual_length=50)
    k0, v0 = _kv(7, seed=1)
    out_k, out_v = layer.update(k0, v0)
    assert out_k is k0 and isinstance(getattr(out_k, TAG), FirstPrefillTag)
    k1, v1 = _kv(1, seed=2)
    out_k, out_v = layer.update(k1, v1)
    assert getattr(out_k, TAG, None) is None and out_k.is_contiguous()
    assert torch.equal(out_k, torch.cat([k0, k1], dim=2)) and torch.equal(out_v, torch.cat([v0, v1], dim=2))


def test_update_tags_the_window_once_something_is_compressed():
    layer = _layer(residual_length=2)
    _fill(layer, [6])
    k, v = _kv(1, seed=9)
    out_k, out_v = layer.update(k, v)
    plan = getattr(out_k, TAG)
    assert isinstance(plan, CompressedPlan) and (plan.num_compressed, plan.num_window) == (5, 2)
    assert torch.equal(out_k[:, :, -1:], k)
    with pytest.raises(RuntimeError, match="never reached the flashquant attention"):
        layer.update(*_kv(1))  # the plan was never served by an attention


# --------------------------------------------------------------------------------------------- cache operations
def test_crop_removes_window_then_compressed_then_sinks():
    layer = _layer(residual_length=4, sink_tokens=2)
    _fill(layer, [20])
    layer.crop(-3)
    assert (layer.num_sink, layer.num_compressed, layer.num_window) == (2, 14, 1)
    layer.crop(-5)
    assert (layer.num_sink, layer.num_compressed, layer.num_window) == (2, 10, 0)
    layer.crop(0)
    assert layer.get_seq_length() == 12
    if _positive_crop_keeps():  # transformers 5.17: a positive value is the length to keep (deprecated there)
        layer.crop(5)
        assert (layer.num_sink, layer.num_compressed, layer.num_window) == (2, 3, 0)
    else:
        with pytest.raises(ValueError, match="negative"):
            layer.crop(5)
        assert layer.get_seq_length() == 12
    layer.crop(-100)
    assert layer.get_seq_length() == 0


def _positive_crop_keeps() -> bool:
    """Whether the installed transformers' DynamicLayer.crop takes a positive value as the length to keep."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    try:
        layer.crop(1)
    except ValueError:
        return False
    return layer.get_seq_length() == 1


def test_crop_then_continue_matches_a_fresh_run_of_the_same_tokens():
    cropped = _layer(residual_length=0)
    keys, values = _fill(cropped, [10, 4])
    cropped.crop(-4)
    fresh = _layer(residual_length=0)
    fresh.update(keys[:, :, :10], values[:, :, :10])
    assert all(torch.equal(a, b) for a, b in zip(cropped.compressed_views(), fresh.compressed_views()))


def test_reorder_and_batch_ops_move_every_tensor():
    layer = _layer(residual_length=3, sink_tokens=1, key_centering=True, value_centering=True)
    _fill(layer, [9, 1])
    before = _snapshot(layer)
    idx = torch.tensor([1, 1])
    layer.reorder_cache(idx)
    for old, new in zip(before[4], _snapshot(layer)[4]):
        assert torch.equal(new, old[idx])
    assert torch.equal(layer.key_mean, before[5][0][idx])

    layer.batch_repeat_interleave(3)
    assert layer.batch_size == 6 and layer.key_mean.shape[0] == 6
    assert all(t.shape[0] == 6 for buf in (layer.sinks, layer.store, layer.window) for t in buf.tensors)
    layer.batch_select_indices(torch.tensor([0, 5]))
    assert layer.batch_size == 2 and layer.compressed_views()[0].shape[0] == 2
    _fill(layer, [2], seed=50)  # still usable with the new batch
    assert layer.get_seq_length() == 12


def test_reset_forgets_everything_and_accepts_a_new_shape():
    layer = _layer(residual_length=2, key_centering=True)
    _fill(layer, [8])
    layer.reset()
    assert not layer.is_initialized and layer.get_seq_length() == 0 and layer.nbytes == 0
    k, v = _kv(5, batch=3)
    layer.update(k, v)
    assert layer.batch_size == 3 and layer.key_mean.shape[0] == 3


def test_offload_and_prefetch_keep_the_content():
    layer = _layer(residual_length=2)
    _fill(layer, [8])
    before = _snapshot(layer)
    layer.offload()
    layer.prefetch()
    assert _same(before, _snapshot(layer))


def test_no_full_precision_keys_attribute():
    layer = _layer()
    with pytest.raises(AttributeError, match="compressed"):
        _ = layer.keys
    assert getattr(layer, "values", None) is None


# --------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize(
    "residual, sinks, chunks, q_len, kc, vc",
    [
        (4, 0, [10, 3], 5, False, False),  # chunk longer than the window: first Lq - W queries see it causally
        (8, 0, [10, 3], 5, True, True),  # window >= chunk: every query sees every compressed key
        (0, 0, [7, 1], 1, False, False),  # decode, everything compressed
        (0, 0, [7], 6, True, True),  # a chunk compressed before it is attended
        (3, 2, [9, 6], 6, True, False),  # sinks + compressed + window
        (16, 1, [20], 7, False, True),
    ],
)
@pytest.mark.parametrize("q_heads", [2, 6])  # MHA and GQA (3 query heads per KV head)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "eager_float", "broadcast"])
def test_compressed_attention_matches_float64_over_dequantized_kv(
    residual, sinks, chunks, q_len, kc, vc, q_heads, mask_kind, gen
):
    layer = _layer(residual_length=residual, sink_tokens=sinks, key_centering=kc, value_centering=vc)
    _fill(layer, chunks, seed=3)
    out_k, _ = layer.update(*_kv(q_len, seed=77))
    plan = getattr(out_k, TAG)
    total = layer.get_seq_length()
    query = torch.randn(B, q_heads, q_len, D, generator=gen)
    mask = None
    if mask_kind == "padding":
        mask = causal_mask(B, q_len, total, pad=[0, 3])
    elif mask_kind == "eager_float":
        mask = causal_mask(B, q_len, total, pad=[2, 0], as_float=torch.float32)
    elif mask_kind == "broadcast":
        mask = causal_mask(1, q_len, total)
    keys, values = layer.dequantize(torch.float64)
    full_mask = causal_mask(B, q_len, total) if mask is None else mask
    expected = float64_attention(query, keys, values, mask_to_bias(full_mask, B, q_len, total), 0.3)
    got = compressed_attention(plan, query, mask, scaling=0.3)
    assert got.shape == (B, q_len, q_heads, D) and got.dtype == query.dtype
    err = (got.double() - expected).abs().max().item()
    assert err < 2e-5, err


def test_compressed_attention_soft_capping_and_irregular_masks_are_exact(gen):
    layer = _layer(residual_length=3, key_centering=True, value_centering=True)
    _fill(layer, [12])
    out_k, _ = layer.update(*_kv(4, seed=5))
    plan = getattr(out_k, TAG)
    total = layer.get_seq_length()
    query = torch.randn(B, 4, 4, D, generator=gen)
    keys, values = layer.dequantize(torch.float64)
    # A sliding window of 6 over a compressed layer: rows see different compressed keys.
    mask = causal_mask(B, 4, total)
    rows = torch.arange(total - 4, total)[:, None]
    mask &= (torch.arange(total)[None, :] > rows - 6)[None, None]
    bias = mask_to_bias(mask, B, 4, total)
    for softcap in (None, 5.0):
        expected = float64_attention(query, keys, values, bias, 0.25, softcap)
        got = compressed_attention(plan, query, mask, scaling=0.25, softcap=softcap)
        assert (got.double() - expected).abs().max().item() < 2e-5


@pytest.mark.parametrize("sliding", [False, True])
def test_compressed_attention_long_chunk_checks_the_mask_in_row_blocks(sliding, gen):
    """A 300-token chunk (more than one 256-row block) over a compressed prefix, with padding."""
    layer = _layer(residual_length=8)
    _fill(layer, [40])
    out_k, _ = layer.update(*_kv(300, seed=6))
    plan = getattr(out_k, TAG)
    total = layer.get_seq_length()
    mask = causal_mask(B, 300, total, pad=[0, 5])
    if sliding:  # irregular: the last rows no longer see the first compressed keys
        rows = torch.arange(total - 300, total)[:, None]
        mask &= (torch.arange(total)[None, :] > rows - 200)[None, None]
    query = torch.randn(B, 4, 300, D, generator=gen)
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query, keys, values, mask_to_bias(mask, B, 300, total), 0.25)
    got = compressed_attention(plan, query, mask, scaling=0.25)
    assert (got.double() - expected).abs().max().item() < 2e-5


def test_compressed_attention_half_precision_model(gen):
    layer = _layer(residual_length=2)
    for n in (9, 1):
        k, v = _kv(n, dtype=torch.bfloat16, seed=n)
        out = layer.update(k, v)
    plan = getattr(out[0], TAG)
    query = torch.randn(B, 4, 1, D, generator=gen).to(torch.bfloat16)
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query.float(), keys, values, None, D**-0.5)
    got = compressed_attention(plan, query, None)
    assert got.dtype == torch.bfloat16
    assert (got.double() - expected).abs().max().item() < 2e-2


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _kv(3, dtype=torch.float64), ValueError, "float16, bfloat16 or float32"),
        (lambda: _kv(3, dim=8), ValueError, "head_dim=16"),
        (lambda: _kv(3, batch=3), ValueError, "batch=2"),
        (lambda: _kv(3, heads=4), ValueError, "kv_heads=2"),
        (lambda: (torch.zeros(B, 3, D), torch.zeros(B, 3, D)), ValueError, r"\[batch, kv_heads, tokens, head_dim\]"),
        (lambda: (torch.zeros(B, H, 3, D), torch.zeros(B, H, 3, 8)), ValueError, "same head_dim"),
        (lambda: (torch.zeros(B, H, 3, D), None), TypeError, "value_states"),
    ],
)
def test_bad_input_raises_and_leaves_the_layer_unchanged(make, error, match):
    layer = _layer(residual_length=2, key_centering=True)
    _fill(layer, [6])
    before = _snapshot(layer)
    with pytest.raises(error, match=match):
        layer.update(*make())
    assert _same(before, _snapshot(layer))


def test_unsupported_head_dims_raise_before_any_state():
    layer = _layer()
    with pytest.raises(ValueError, match="even head_dim"):
        layer.update(*_kv(3, dim=3))
    assert not layer.is_initialized
    layer = _layer(rotation="hadamard")
    with pytest.raises(ValueError, match="power-of-two"):
        layer.update(*_kv(3, dim=24))
    assert not layer.is_initialized


def test_failed_cache_update_adds_no_layer():
    cache = TurboQuantCache(backend="torch")
    cache.update(*_kv(4), layer_idx=0)
    with pytest.raises(ValueError):
        cache.update(*_kv(4, dtype=torch.float64), layer_idx=3)
    assert len(cache.layers) == 1 and cache.get_seq_length() == 4


def test_bad_query_and_mask_raise(gen):
    layer = _layer(residual_length=1)
    _fill(layer, [5])
    out_k, _ = layer.update(*_kv(1))
    plan = getattr(out_k, TAG)
    with pytest.raises(ValueError, match="`query`"):
        compressed_attention(plan, torch.randn(B, 3, 1, D, generator=gen), None)
    out_k, _ = layer.update(*_kv(1))
    plan = getattr(out_k, TAG)
    with pytest.raises(ValueError, match="attention_mask"):
        compressed_attention(plan, torch.randn(B, 4, 1, D, generator=gen), torch.ones(B, 1, 1, 3, dtype=torch.bool))


def test_cache_builds_from_overrides_and_configs():
    cache = TurboQuantCache(TurboQuantConfig(bits=3), residual_length=0)
    assert (cache.config.bits, cache.config.residual_length) == (3, 0)
    assert TurboQuantCache(bits=2).config.value_bits == 2
    with pytest.raises(TypeError, match="TurboQuantConfig"):
        TurboQuantCache(config={"bits": 3})
    with pytest.raises(ValueError, match="`bits`"):
        TurboQuantCache(bits=8)


def _interface_mappings() -> tuple[dict, dict]:
    """Copies of transformers' global attention and mask-function mappings."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


def _check_installed(attention_before: dict, masks_before: dict) -> None:
    """"turboquant" added to both interfaces, sdpa and eager wrapped around what was there, nothing else touched."""
    from flashquant_hf.registration import flashquant_attention_forward

    attention, masks = _interface_mappings()
    assert attention["turboquant"] is flashquant_attention_forward
    assert masks == {**masks_before, "turboquant": masks["turboquant"]}
    assert attention["sdpa"]._flashquant_original is attention_before["sdpa"]
    assert attention["eager"]._flashquant_original is attention_before.get("eager")
    unrouted = {name: fn for name, fn in attention.items() if name not in ("sdpa", "eager", "turboquant")}
    assert unrouted == {name: fn for name, fn in attention_before.items() if name not in ("sdpa", "eager")}


def test_install_routes_sdpa_and_eager_only_and_uninstall_restores_the_interfaces():
    uninstall()
    before = _interface_mappings()
    install()
    _check_installed(*before)
    installed = _interface_mappings()
    install()  # idempotent
    assert _interface_mappings() == installed

    layer = _layer(residual_length=1)
    _fill(layer, [5])
    out_k, out_v = layer.update(*_kv(1))
    query = torch.randn(B, 4, 1, D, generator=torch.Generator().manual_seed(3))
    routed, _ = installed[0]["sdpa"](torch.nn.Module(), query, out_k, out_v, None)
    assert layer._pending is None  # the routed sdpa served the compressed plan
    assert torch.equal(routed, compressed_attention(getattr(out_k, TAG), query, None))

    uninstall()
    assert _interface_mappings() == before
    TurboQuantCache()  # a new cache installs again
    _check_installed(*before)


def test_uninstall_keeps_an_implementation_registered_after_install():
    from transformers.modeling_utils import AttentionInterface

    install()
    original = AttentionInterface._global_mapping["sdpa"]._flashquant_original
    custom = lambda *args, **kwargs: original(*args, **kwargs)  # noqa: E731
    AttentionInterface.register("sdpa", custom)
    try:
        uninstall()
        assert AttentionInterface._global_mapping["sdpa"] is custom
    finally:
        AttentionInterface.register("sdpa", original)
        install()


@pytest.mark.parametrize("bits", [4, 3])
def test_compressed_views_follow_the_store(bits):
    """The views the attention reads are made once per state of the store (at 3 bits and D 64 the norms follow the
    code rows and are split from them): after every step they equal the store's live tokens, split here."""
    layer = TurboQuantLayer(TurboQuantConfig(backend="torch", bits=bits, residual_length=8, window_block=4,
                                             sink_tokens=2), layer_idx=0)
    gen = torch.Generator().manual_seed(7)
    for step in range(40):
        k, v = _kv(int(torch.randint(1, 4, (), generator=gen)), dim=64, seed=100 + step)
        plan = getattr(layer.update(k, v)[0], TAG, None)
        if isinstance(plan, CompressedPlan):
            layer.consume_plan(plan)
        if step == 20:
            layer.reorder_cache(torch.tensor([1, 0]))
        if step == 30:
            layer.crop(-3)
        if not layer.num_compressed:
            continue
        views = layer.compressed_views()
        assert all(a is b for a, b in zip(views, layer.compressed_views(), strict=True))
        store = layer.store
        live = [t[:, :, store.start : store.start + store.length] for t in store.tensors]
        inline = bits == 3
        assert layer.norms_inline == (inline, inline) and len(live) == (2 if inline else 4)
        want = [part for rows in live for part in (rows[..., :-4], rows[..., -4:].contiguous().view(torch.float32)[
            ..., 0])] if inline else live
        assert [v.shape for v in views] == [w.shape for w in want]
        assert all(torch.equal(v, w) for v, w in zip(views, want))
