"""Every supported family (tiny random configs) and the embedded SmolLM2; unsupported models fail clearly."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_helpers import (
    FAMILIES,
    cache_kwargs,
    deepseek_v3_config,
    one_thread,
    prompt_ids,
    qwen3_next_config,
    tiny_model,
)
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from flashquant_hf import TurboQuantCache, TurboQuantLayer


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _teacher_forced_logits(model, cache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of every position from ``prefill - 1`` on: one prefill, then one token per step. [B, T, vocab]"""
    kwargs = cache_kwargs(model, cache)
    with torch.inference_mode():
        logits = [model(ids[:, :prefill], **kwargs, use_cache=True).logits[:, -1]]
        for t in range(prefill, ids.shape[1] - 1):
            logits.append(model(ids[:, t : t + 1], **kwargs, use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_identical_while_exact_and_close_when_compressed(family):
    model = tiny_model(family)
    ids = prompt_ids(2, 20, seed=11)
    expected = _teacher_forced_logits(model, DynamicCache(config=model.config), ids, prefill=10)

    exact_cache = TurboQuantCache(residual_length=1024)
    assert torch.equal(_teacher_forced_logits(model, exact_cache, ids, prefill=10), expected)

    cache = TurboQuantCache(residual_length=2, window_block=1)
    got = _teacher_forced_logits(model, cache, ids, prefill=10)
    spread = (expected - expected.mean(-1, keepdim=True)).norm()
    assert ((got - expected).norm() / spread).item() < 0.15  # TQ4 on random tiny models: 0.02 - 0.06
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75

    text = model.config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or (
        ["sliding_attention"] * text.num_hidden_layers if getattr(text, "sliding_window", None) else None
    )
    for idx, layer in enumerate(cache.layers):
        sliding = layer_types is not None and layer_types[idx] == "sliding_attention"
        # Layer types were learnt from the model during the first forward: sliding layers stay exact.
        assert isinstance(layer, DynamicSlidingWindowLayer if sliding else TurboQuantLayer), (idx, layer)
        if not sliding:
            assert layer.num_compressed == 20 - 1 - 2 - layer.num_sink


@pytest.mark.parametrize("family", ["gemma2", "mistral_sliding", "qwen3"])
def test_cache_built_from_the_model_config_matches_the_lazy_one(family):
    model = tiny_model(family)
    ids = prompt_ids(1, 14, seed=12)
    lazy = _teacher_forced_logits(model, TurboQuantCache(residual_length=1, window_block=1), ids, prefill=6)
    typed_cache = TurboQuantCache(model.config, residual_length=1, window_block=1)
    assert [type(layer) for layer in typed_cache.layers] == [
        TurboQuantLayer if t == "full_attention" else DynamicSlidingWindowLayer for t, _ in typed_cache._layer_types
    ]
    typed = _teacher_forced_logits(model, typed_cache, ids, prefill=6)
    assert torch.equal(lazy, typed)


def test_sinks_and_centring_run_through_a_model():
    model = tiny_model("qwen3")
    ids = prompt_ids(2, 18, seed=13)
    expected = _teacher_forced_logits(model, DynamicCache(), ids, prefill=8)
    cache = TurboQuantCache(
        residual_length=3, window_block=1, sink_tokens=2, key_centering=True, value_centering=True, bits=3
    )
    got = _teacher_forced_logits(model, cache, ids, prefill=8)
    assert ((got - expected).norm() / (expected - expected.mean(-1, keepdim=True)).norm()).item() < 0.2
    assert cache.layers[0].num_sink == 2 and cache.layers[0].key_mean is not None


# --------------------------------------------------------------------------------------------- unsupported models
def test_mla_model_is_rejected_with_its_layer_type():
    config = deepseek_v3_config()
    with pytest.raises(ValueError, match="multi-head latent attention"):
        TurboQuantCache(model_config=config)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    cache = TurboQuantCache()
    with pytest.raises(ValueError, match="multi-head latent attention"):
        model(prompt_ids(1, 5), **cache_kwargs(model, cache), use_cache=True)
    assert len(cache.layers) == 0 and cache.get_seq_length() == 0


def test_linear_attention_model_is_rejected_with_its_layer_type():
    config = qwen3_next_config()
    with pytest.raises(ValueError, match="'linear_attention'"):
        TurboQuantCache(config)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    cache = TurboQuantCache()
    with pytest.raises(NotImplementedError, match="linear-attention"):
        model(prompt_ids(1, 5), **cache_kwargs(model, cache), use_cache=True)
    assert len(cache.layers) == 0


# --------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    from flashquant_hf.models import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def english_ids(smollm2):
    """Deterministic English text: CPython's pydoc topics, tokenized ([1, >= 1100])."""
    from pydoc_data.topics import topics

    _, tokenizer = smollm2
    text = "\n".join(topics[key] for key in sorted(topics)[:8])
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] >= 1100
    return ids


@pytest.mark.slow
def test_smollm2_every_token_compressed_agrees_with_dynamic_cache(smollm2, english_ids):
    """residual_length=0: 256 teacher-forced decode steps, top-1 vs DynamicCache; then a follow-up turn."""
    model, _ = smollm2
    prefill, steps = 128, 256
    ids = english_ids[:, : prefill + steps]
    with torch.inference_mode():  # DynamicCache's top-1 for every position, in one forward
        logits = model(ids, **cache_kwargs(model, DynamicCache()), use_cache=True).logits
    expected = logits[0, prefill - 1 : -1].argmax(-1)
    cache = TurboQuantCache(residual_length=0, sink_tokens=0)  # every token compressed
    got = _teacher_forced_logits(model, cache, ids, prefill)[0].argmax(-1)
    agreement = (got == expected).float().mean().item()
    print(f"top-1 agreement with DynamicCache over {steps} steps: {agreement:.3f}")
    assert agreement >= 0.80
    assert cache.layers[0].num_compressed == prefill + steps - 1

    follow_up = english_ids[:, prefill + steps : prefill + steps + 12]
    turn = torch.cat([ids[:, :-1], follow_up], dim=1)  # the cache holds every token but the last of `ids`
    with torch.inference_mode():
        out = model.generate(turn, max_new_tokens=8, do_sample=False, **cache_kwargs(model, cache))
    assert out.shape == (1, turn.shape[1] + 8)
    assert cache.get_seq_length() == turn.shape[1] + 7


@pytest.mark.slow
def test_smollm2_nbytes_at_1024_tokens(smollm2, english_ids):
    model, _ = smollm2
    cache = TurboQuantCache(residual_length=0, sink_tokens=0, bits=4)  # every token compressed
    with torch.inference_mode():
        model(english_ids[:, :1024], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    bound = 30 * 3 * 1024 * (64 + 8)
    print(f"nbytes {cache.nbytes} = {cache.nbytes / bound:.4f} x the TQ4 bound")
    assert cache.get_seq_length() == 1024
    assert cache.nbytes <= 1.05 * bound
