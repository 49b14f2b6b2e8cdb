"""Inline norms (``flashquant_hf.store_layout``): which sides store their norms after their code rows, the views of
such rows, and caches whose store uses them: the same codes, views and logits as a store of separate norms."""

from __future__ import annotations

import pytest
import torch
import transformers

from flashquant_hf import TurboQuantCache, TurboQuantConfig, TurboQuantLayer, store_layout
from flashquant_hf.cache import cache_kwargs
from flashquant_hf.packing import packed_size
from flashquant_hf.tags import TAG, CompressedPlan


@pytest.mark.parametrize("head_dim, k_bits, v_bits, sides", [
    (128, 3, 3, (True, True)), (128, 3, 2, (True, True)), (128, 3, 1, (True, True)), (128, 1, 3, (True, True)),
    (128, 4, 3, (False, True)),  # a 68-byte key row would break the 16-byte key loads
    (128, 2, 3, (False, True)),  # 36 bytes: the 8-byte key loads
    (128, 3, 4, (True, False)),  # 68 bytes: the 8-byte value loads
    (128, 4, 4, (False, False)), (128, 2, 2, (False, False)), (128, 4, 2, (False, False)),  # tiles not staged
    (64, 3, 3, (True, True)), (64, 3, 2, (True, True)), (64, 4, 3, (False, True)), (64, 2, 3, (True, True)),
    (64, 4, 4, (False, False)), (256, 3, 3, (False, False)),  # head_dim 256 runs 4 warps, never staged
])
def test_inline_sides(head_dim, k_bits, v_bits, sides):
    assert store_layout.inline_norms(head_dim, k_bits, v_bits) == sides


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_inline_rows_keep_the_lane_load_alignment(head_dim):
    for k_bits in (1, 2, 3, 4):
        for v_bits in (1, 2, 3, 4):
            sides = store_layout.inline_norms(head_dim, k_bits, v_bits)
            assert not any(sides) or store_layout.contiguous_staging_pays(head_dim, k_bits, v_bits)
            for inline, bits, keys in zip(sides, (k_bits, v_bits), (True, False)):
                pitch = packed_size(head_dim, bits) + store_layout.NORM_BYTES
                keeps = pitch % store_layout.slice_alignment(head_dim, bits, keys) == 0
                assert not inline or keeps, (k_bits, v_bits, keys)


def test_split_rows_are_views_of_joined_rows():
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (2, 3, 7, 48), dtype=torch.uint8, generator=gen)
    norms = torch.rand(2, 3, 7, generator=gen) * 10
    rows = store_layout.joined_rows(packed, norms)
    assert rows.shape == (2, 3, 7, 52) and rows.dtype == torch.uint8
    got_packed, got_norms = store_layout.split_rows(rows)
    assert torch.equal(got_packed, packed) and torch.equal(got_norms, norms)
    assert got_norms.stride() == (3 * 7 * 13, 7 * 13, 13)
    assert got_packed.data_ptr() == rows.data_ptr() and got_norms.data_ptr() == rows.data_ptr() + 48
    got_norms[1, 2, 3] = -1.5  # a write through the view lands in the row, after its codes
    assert store_layout.split_rows(rows)[1][1, 2, 3] == -1.5 and torch.equal(rows[1, 2, 3, :48], packed[1, 2, 3])


def _separate(monkeypatch):
    """Caches built after this keep separate norms at every width."""
    monkeypatch.setattr("flashquant_hf.layer.inline_norms", lambda *args: (False, False))


def _kv(length, seed, dim=128, batch=2, heads=2):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, dim, generator=gen) for _ in range(2))


def _fill(layer, steps):
    for k, v in steps:
        plan = getattr(layer.update(k, v)[0], TAG, None)
        if isinstance(plan, CompressedPlan):
            layer.consume_plan(plan)  # no attention runs in these storage tests


@pytest.mark.parametrize("bits, dim, sides", [(3, 128, (True, True)), (2.5, 64, (True, True)),
                                              (3.5, 128, (False, True))])
def test_inline_store_holds_the_separate_stores_codes(bits, dim, sides, monkeypatch):
    config = TurboQuantConfig(bits=bits, residual_length=8, window_block=4, sink_tokens=2)
    inline = TurboQuantLayer(config)
    steps = [_kv(37, 1, dim)] + [_kv(1, 10 + i, dim) for i in range(9)]
    _fill(inline, steps)
    assert inline.norms_inline == sides
    assert len(inline.store.tensors) == 4 - sum(sides)
    for tensor, side_inline, bits_side in zip(inline.store.tensors[:: 2 - sides[0]], sides, (
            config.key_bits, config.value_bits)):
        if side_inline:
            assert tensor.dtype == torch.uint8 and tensor.shape[-1] == packed_size(dim, bits_side) + 4
    _separate(monkeypatch)
    separate = TurboQuantLayer(config)
    _fill(separate, steps)
    assert separate.norms_inline == (False, False) and len(separate.store.tensors) == 4
    assert inline.num_compressed == separate.num_compressed >= 32
    for got, want in zip(inline.compressed_views(), separate.compressed_views(), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)
    assert inline.stored_nbytes == separate.stored_nbytes
    for got, want in zip(inline.dequantize(), separate.dequantize()):
        assert torch.equal(got, want)
    index = torch.tensor([1, 0])
    before = [t.clone() for t in separate.compressed_views()]
    inline.reorder_cache(index)
    for got, want in zip(inline.compressed_views(), before):
        assert torch.equal(got, want.index_select(0, index))
    inline.batch_repeat_interleave(2)
    assert inline.compressed_views()[1].shape[0] == 4
    assert torch.equal(inline.compressed_views()[1][2:], before[1][[0, 0]])


def _model(head_dim: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def _logits(model, cache, prompt, steps):
    logits = []
    with torch.no_grad():
        out = model(prompt, **cache_kwargs(model, cache))
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            out = model(logits[-1].argmax(-1, keepdim=True), **cache_kwargs(model, cache))
    return torch.stack(logits)


@pytest.mark.parametrize("max_cache_len", [None, 96])
def test_inline_cache_decodes_as_the_separate_one(max_cache_len, monkeypatch):
    """Dynamic and static modes, bits=3 at head_dim 128: the same logits with either store."""
    model = _model(128)
    prompt = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    kwargs = dict(bits=3, residual_length=16, window_block=8, sink_tokens=4, max_cache_len=max_cache_len)
    cache = TurboQuantCache(**kwargs)
    got = _logits(model, cache, prompt, 24)
    assert cache.layers[0].norms_inline == (True, True)
    if max_cache_len:
        assert [t.shape[-1] for t in cache.layers[0].store_tensors] == [52, 52]
    _separate(monkeypatch)
    separate = TurboQuantCache(**kwargs)
    want = _logits(model, separate, prompt, 24)
    assert separate.layers[0].norms_inline == (False, False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_static_store_runs_stay_aligned_at_any_capacity(bits):
    """Whatever max_cache_len gives, the static store's (sequence, head) runs start 16-byte aligned, so the staged
    decode can copy them (decode_launch.contiguous_runs finds a layout, the store's inline sides where it has any)."""
    from flashquant_hf.kernels.decode_launch import contiguous_runs

    for max_cache_len in (93, 101, 130):
        cache = TurboQuantCache(max_cache_len=max_cache_len, bits=bits, residual_length=16, window_block=8,
                                sink_tokens=4)
        k, v = _kv(max_cache_len - 3, 4)
        cache.update(k, v, 0)
        layer = cache.layers[0]
        assert layer.num_compressed > 0
        capacity = layer.store_capacity
        sides = [(p[:, :, :capacity], n) for p, n in layer.store_sides()]
        views = []
        for packed, norms in sides:
            views += store_layout.split_rows(packed) if norms is None else [packed, norms[:, :, :capacity]]
        assert contiguous_runs(*views) == layer.norms_inline, max_cache_len
