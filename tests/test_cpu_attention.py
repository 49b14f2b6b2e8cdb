"""The CPU path of a TurboQuantLayer's attention (sinks, compressed part and window in one softmax, codes read by
table lookup) against float64 attention over the dequantized K/V and against the reference path it replaces
(``ops.tq_attention`` on the reference + exact parts + ``merge_partials``)."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import causal_mask, float64_attention

from flashquant_hf import TurboQuantConfig, TurboQuantLayer, attention, ops
from flashquant_hf.attention import compressed_attention
from flashquant_hf.masks import mask_to_bias
from flashquant_hf.tags import TAG

B, H, D = 2, 2, 64


def _layer_with_query(key_bits, value_bits, q_len, q_heads, seed, **overrides):
    """A layer holding 4 sinks, a compressed part and a window over 41 + q_len tokens; its plan and a query."""
    gen = torch.Generator().manual_seed(seed)
    settings = dict(key_bits=key_bits, value_bits=value_bits, sink_tokens=4, residual_length=8, window_block=4,
                    key_centering=True, value_centering=True, norm_correction=True, backend="torch")
    layer = TurboQuantLayer(TurboQuantConfig(**{**settings, **overrides}), layer_idx=0)
    for step, n in enumerate((40, 1, q_len)):
        k, v = torch.randn(2, B, H, n, D, generator=gen)
        out_k, _ = layer.update(k, v)
        plan = getattr(out_k, TAG)
        if step < 2 and hasattr(plan, "num_compressed"):
            layer.consume_plan(plan)  # no attention runs for the filling steps
    query = torch.randn(B, q_heads, q_len, D, generator=gen)
    return layer, plan, query


def _reference_path(plan, query, mask, scale, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(ops, "attends_in_one_softmax", lambda backend, query: False)
        plan.layer._pending = plan
        return compressed_attention(plan, query, mask, scaling=scale)


@pytest.mark.parametrize("key_bits, value_bits", [(4, 4), (3, 3), (3, 2), (2, 2)])  # 2.5 bits: keys 3, values 2
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("q_heads", [2, 6])  # MHA and GQA
@pytest.mark.parametrize("padding", [None, [0, 5]])  # left padding of the second row
def test_cpu_path_matches_float64_and_the_reference_path(key_bits, value_bits, q_len, q_heads, padding, monkeypatch):
    layer, plan, query = _layer_with_query(key_bits, value_bits, q_len, q_heads, seed=key_bits * 10 + q_len)
    assert layer.num_sink == 4 and 8 <= layer.num_window < 12 and layer.num_compressed > 20
    total = layer.get_seq_length()
    mask = causal_mask(B, q_len, total, pad=padding) if padding else None
    keys, values = layer.dequantize(torch.float64)
    full_mask = mask if mask is not None else causal_mask(B, q_len, total)
    expected = float64_attention(query, keys, values, mask_to_bias(full_mask, B, q_len, total), 0.125)
    got = compressed_attention(plan, query, mask, scaling=0.125)
    reference = _reference_path(plan, query, mask, 0.125, monkeypatch)
    assert got.shape == (B, q_len, q_heads, D)
    assert (got.double() - expected).abs().max().item() < 2e-5
    assert (got - reference).abs().max().item() < 2e-5


def test_split_codes_and_soft_capping_take_the_cpu_path_too():
    layer, plan, query = _layer_with_query(3, 3, 1, 6, seed=5, outlier_channels=8, key_qjl=True)
    assert not layer.is_plain
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query, keys, values, None, 0.125, softcap=3.0)
    got = compressed_attention(plan, query, None, scaling=0.125, softcap=3.0)
    assert (got.double() - expected).abs().max().item() < 2e-5


def test_a_row_that_sees_nothing_gives_zeros():
    layer, plan, query = _layer_with_query(4, 4, 2, 2, seed=9)
    total = layer.get_seq_length()
    mask = causal_mask(B, 2, total)
    mask[1, :, 0] = False  # the first query of the second row sees no key
    got = compressed_attention(plan, query, mask, scaling=0.125)
    assert torch.isfinite(got).all() and not got[1, 0].any() and got[1, 1].abs().sum() > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_runs_on_one_thread_and_leaves_the_callers_threads(threads, monkeypatch):
    layer, plan, query = _layer_with_query(4, 4, 1, 6, seed=11)
    inside = []
    rows = attention._merged_rows
    monkeypatch.setattr(attention, "_merged_rows", lambda *args: inside.append(torch.get_num_threads()) or rows(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = compressed_attention(plan, query, None, scaling=0.125)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert inside == [1] and after == threads
    keys, values = layer.dequantize(torch.float64)
    expected = float64_attention(query, keys, values, None, 0.125)
    assert (got.double() - expected).abs().max().item() < 2e-5


def test_a_failing_decode_leaves_the_callers_threads(monkeypatch):
    layer, plan, query = _layer_with_query(4, 4, 1, 6, seed=12)

    def fail(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(attention, "_merged_rows", fail)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            compressed_attention(plan, query, None, scaling=0.125)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert after == 2