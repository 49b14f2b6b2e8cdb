"""What a TurboQuantCache allocates (``nbytes``) against what it holds (``stored_nbytes``, checked against a
byte count from the token counts), and against DynamicCache at short prompts."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import one_thread, prompt_ids, tiny_model

from flashquant_hf import TurboQuantCache, TurboQuantConfig, TurboQuantLayer
from flashquant_hf.cache import cache_kwargs
from flashquant_hf.tags import TAG, CompressedPlan

B, H, D, LAYERS = 1, 2, 64, 2
EVERY_TOKEN_COMPRESSED = dict(residual_length=0, sink_tokens=0)


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _feed(cache: TurboQuantCache, chunks: list[int], seed: int = 0) -> None:
    """Random fp32 K/V in chunks of tokens to every layer, as a model's forward would (no attention runs)."""
    gen = torch.Generator().manual_seed(seed)
    for count in chunks:
        for layer_idx in range(LAYERS):
            k, v = (torch.randn(B, H, count, D, generator=gen) for _ in range(2))
            plan = getattr(cache.update(k, v, layer_idx)[0], TAG, None)
            if isinstance(plan, CompressedPlan):
                cache.layers[layer_idx].consume_plan(plan)


def _held_bytes(cache: TurboQuantCache, exact_bytes_per_token: int, tq4_bytes_per_token: int) -> int:
    """Bytes of the tokens the cache holds (exact sinks and window, TQ4 codes) and of its centring means."""
    total = 0
    for layer in cache.layers:
        total += (layer.num_sink + layer.num_window) * exact_bytes_per_token
        total += layer.num_compressed * tq4_bytes_per_token
        total += sum(m.numel() * 4 for m in (layer.key_mean, layer.value_mean) if m is not None)
    return total


EXACT_FP32 = 2 * B * H * D * 4  # key + value, fp32
TQ4 = 2 * B * H * (D // 2 + 4)  # key + value: nibble-packed codes + fp32 norm


@pytest.mark.parametrize("config", [EVERY_TOKEN_COMPRESSED, {}], ids=["every-token-compressed", "default"])
@pytest.mark.parametrize("prefill, decode", [(897, 128), (32001, 768)], ids=["1K", "32K"])
def test_allocated_bytes_are_within_5_percent_of_what_the_cache_holds(config, prefill, decode):
    cache = TurboQuantCache(bits=4, backend="torch", **config)
    _feed(cache, [prefill])
    held = _held_bytes(cache, EXACT_FP32, TQ4)
    assert cache.stored_nbytes == held
    checks = [("prefill", cache.nbytes, held)]
    _feed(cache, [1] * decode, seed=1)
    held = _held_bytes(cache, EXACT_FP32, TQ4)
    assert cache.stored_nbytes == held and cache.get_seq_length() == prefill + decode
    checks.append(("decode", cache.nbytes, held))
    for phase, allocated, held in checks:
        print(f"{phase}: allocated {allocated} B = {allocated / held:.4f} x held")
    if config:
        for phase, allocated, held in checks:
            assert allocated <= 1.05 * held, phase
    else:
        # The default exact window holds residual_length to residual_length + window_block - 1 tokens and is
        # allocated for the most it holds: beyond 1.05x only by that block of exact tokens.
        window_block = cache.config.window_block - 1
        for phase, allocated, held in checks:
            assert allocated <= 1.05 * held + LAYERS * window_block * EXACT_FP32, phase
            if prefill >= 32000:
                assert allocated <= 1.05 * held, phase


def _forward(model, cache, ids: torch.Tensor) -> None:
    with torch.inference_mode():
        model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)


def _dynamic_cache_bytes(model, tokens: int, batch: int = 1) -> int:
    """What DynamicCache holds for ``tokens`` tokens: exact fp32 K/V of every layer."""
    cfg = model.config
    return cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * tokens * cfg.head_dim * 4


def test_model_with_every_token_compressed_allocates_within_5_percent_after_prefill_and_decode():
    """896 prefill + 128 decode tokens through a tiny Llama: the store grows with the decode steps."""
    model = tiny_model("llama")
    cfg = model.config
    ids = prompt_ids(1, 1024, seed=3)
    cache = TurboQuantCache(bits=4, **EVERY_TOKEN_COMPRESSED)
    tq4 = 2 * cfg.num_key_value_heads * (cfg.head_dim // 2 + 4)
    exact = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    _forward(model, cache, ids[:, :896])
    for phase in ("prefill", "decode"):
        if phase == "decode":
            for pos in range(896, 1024):
                _forward(model, cache, ids[:, pos : pos + 1])
        held = _held_bytes(cache, exact, tq4)
        print(f"{phase}: allocated {cache.nbytes} B = {cache.nbytes / held:.4f} x held")
        assert cache.stored_nbytes == held
        assert cache.nbytes <= 1.05 * held, phase
    assert cache.get_seq_length() == 1024


@pytest.mark.parametrize("length", [1, 3, 17, 150, 199, 300])
def test_short_prompt_costs_no_more_than_dynamic_cache(length):
    """The exact window is allocated as it fills: no prompt, and no decode step after it, costs more bytes than
    DynamicCache's exact K/V of the same tokens."""
    model = tiny_model("llama")
    ids = prompt_ids(1, length + 3, seed=length)
    cache = TurboQuantCache()
    _forward(model, cache, ids[:, :length])
    assert cache.nbytes <= _dynamic_cache_bytes(model, length)
    for pos in range(length, length + 3):
        _forward(model, cache, ids[:, pos : pos + 1])
        assert cache.nbytes <= _dynamic_cache_bytes(model, pos + 1)
    assert cache.get_seq_length() == length + 3


@pytest.mark.slow
def test_smollm2_every_token_compressed_allocates_within_5_percent_after_decode():
    """The embedded model, 896 prefill + 128 more tokens in steps of 16 (one forward per step instead of 128, which
    costs the store the same growths), every token compressed (30 layers, 3 KV heads, D=64)."""
    from flashquant_hf.models import load_smollm2

    model, _ = load_smollm2()
    ids = prompt_ids(1, 1024, seed=4) + 100  # token ids well inside SmolLM2's vocabulary
    cache = TurboQuantCache(bits=4, **EVERY_TOKEN_COMPRESSED)
    tq4 = 2 * 3 * (64 // 2 + 4)
    _forward(model, cache, ids[:, :896])
    for pos in range(896, 1024, 16):
        _forward(model, cache, ids[:, pos : pos + 16])
    held = _held_bytes(cache, 2 * 3 * 64 * 4, tq4)
    print(f"allocated {cache.nbytes} B = {cache.nbytes / held:.4f} x held")
    assert cache.stored_nbytes == held and cache.get_seq_length() == 1024
    assert cache.nbytes <= 1.05 * held


def _layer_fed(config: dict, chunks: list[torch.Tensor], crop: int = 0) -> TurboQuantLayer:
    layer = TurboQuantLayer(TurboQuantConfig(backend="torch", **config), layer_idx=0)
    for i, (k, v) in enumerate(chunks):
        plan = getattr(layer.update(k, v)[0], TAG, None)
        if isinstance(plan, CompressedPlan):
            layer.consume_plan(plan)
        if i == 0 and crop:
            layer.crop(-crop)
    return layer


@pytest.mark.parametrize("crop", [0, 6], ids=["decode", "crop-into-the-prompt"])
def test_statistics_of_a_first_prompt_that_compresses_nothing_are_bit_identical(crop):
    """A first prompt kept exact holds no means or channel orders: they are taken when its first token is
    compressed (or before a crop removes some of its tokens), from its exact tokens in the prompt's memory layout,
    and equal bit for bit those of a layer that compressed the same prompt at once."""
    gen = torch.Generator().manual_seed(5)
    # K/V as a model's attention passes them: [B, L, H, D] memory viewed as [B, H, L, D]
    prompt = [torch.randn(2, 10, 3, 16, generator=gen).transpose(1, 2) for _ in range(2)]
    steps = [tuple(torch.randn(2, 3, 1, 16, generator=gen) for _ in range(2)) for _ in range(12)]
    levers = dict(bits=3, outlier_channels=4, key_centering=True, value_centering=True, sink_tokens=2)
    eager = _layer_fed({**levers, "residual_length": 0}, [prompt])
    lazy = _layer_fed({**levers, "residual_length": 8, "window_block": 1}, [prompt], crop=crop)
    assert (lazy.key_mean is None) == (crop == 0)
    if crop == 0:
        assert lazy.nbytes == lazy.stored_nbytes == 2 * 2 * 3 * 10 * 16 * 4  # the prompt's exact K/V only
    for k, v in steps:
        plan = getattr(lazy.update(k, v)[0], TAG, None)
        if isinstance(plan, CompressedPlan):
            lazy.consume_plan(plan)
    assert lazy.num_compressed > 0
    for name in ("key_mean", "value_mean", "key_order", "value_order"):
        assert torch.equal(getattr(lazy, name), getattr(eager, name)), name
