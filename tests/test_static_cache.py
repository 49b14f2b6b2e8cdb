"""The static-capacity mode, ``TurboQuantCache(max_cache_len=N)``, on the CPU reference path: the same logits and
greedy tokens as the dynamic mode (which the rest of the suite checks against DynamicCache), fixed storage after
the first prefill, a decode step dynamo traces as one graph, and clear refusals."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from flashquant_hf import TurboQuantCache
from flashquant_hf.cache import cache_kwargs
from flashquant_hf.static_layer import StaticTurboQuantLayer

# A window of 16 exact tokens left 8 at a time: a 40-token prompt and 64 decode steps compress 8 blocks in decode.
SMALL_WINDOW = dict(residual_length=16, window_block=8, sink_tokens=4)
PROMPT = 40
STEPS = 64
CAPACITY = 128

MODELS = {
    "llama_d64_gqa4": ("LlamaConfig", "LlamaForCausalLM", 64),
    "llama_d128_gqa4": ("LlamaConfig", "LlamaForCausalLM", 128),
    "qwen3_d64_gqa4": ("Qwen3Config", "Qwen3ForCausalLM", 64),
}


def _model(name: str, layers: int = 2) -> transformers.PreTrainedModel:
    config_name, model_name, head_dim = MODELS[name]
    config = getattr(transformers, config_name)(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _prompt(seed: int, batch: int = 2, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(model, cache, prompt: torch.Tensor, steps: int, forward=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-position logits of the prefill and every step [steps + 1, B, V], greedy tokens [steps + 1, B])."""
    forward = forward if forward is not None else model
    logits = []
    with torch.no_grad():
        out = model(prompt, **cache_kwargs(model, cache))
        for _ in range(steps + 1):
            logits.append(out.logits[:, -1].float())
            if len(logits) > steps:
                break
            out = forward(logits[-1].argmax(-1, keepdim=True), **cache_kwargs(model, cache))
    stacked = torch.stack(logits)
    return stacked, stacked.argmax(-1)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_equals_dynamic(name):
    model = _model(name)
    prompt = _prompt(1)
    dynamic = TurboQuantCache(**SMALL_WINDOW)
    dynamic_logits, dynamic_tokens = _greedy(model, dynamic, prompt, STEPS)
    cache = TurboQuantCache(max_cache_len=CAPACITY, **SMALL_WINDOW)
    static_logits, static_tokens = _greedy(model, cache, prompt, STEPS)
    assert torch.equal(static_tokens, dynamic_tokens)
    torch.testing.assert_close(static_logits, dynamic_logits, rtol=1e-4, atol=1e-4)  # summation order only
    layer = cache.layers[0]
    assert isinstance(layer, StaticTurboQuantLayer)
    held = PROMPT + STEPS
    # 8 blocks left the window during decode; the window keeps 16 to 23 tokens.
    assert layer.num_compressed == (held - 4 - 16) // 8 * 8 and layer.num_compressed >= 8 * 8
    assert layer.num_sink + layer.num_compressed + layer.num_window == held == int(cache.get_seq_length())
    # Bytes held: the same tokens as the dynamic mode's, in codes and exact tokens; allocated: the capacity.
    assert cache.stored_nbytes == dynamic.stored_nbytes < cache.nbytes


def test_static_holds_what_dynamic_holds():
    """Same codes, sinks and window (dequantized) after prefill and decode: one layout of tokens in both modes."""
    model = _model("llama_d64_gqa4", layers=1)
    dynamic, static = TurboQuantCache(**SMALL_WINDOW), TurboQuantCache(max_cache_len=CAPACITY, **SMALL_WINDOW)
    for cache in (dynamic, static):
        _greedy(model, cache, _prompt(2), 21)
    for got, want in zip(static.layers[0].dequantize(), dynamic.layers[0].dequantize()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_short_prompt_fills_sinks_then_window():
    """A prompt shorter than the sinks: the first decode tokens complete the sinks, as in the dynamic mode."""
    model = _model("llama_d64_gqa4")
    prompt = _prompt(3, length=2)
    want, _ = _greedy(model, TurboQuantCache(**SMALL_WINDOW), prompt, 40)
    got, _ = _greedy(model, TurboQuantCache(max_cache_len=64, **SMALL_WINDOW), prompt, 40)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_every_token_compressed():
    """``residual_length=0, sink_tokens=0``: each new token is compressed before it is attended."""
    model = _model("llama_d64_gqa4")
    settings = dict(residual_length=0, sink_tokens=0)
    want, _ = _greedy(model, TurboQuantCache(**settings), _prompt(4), 12)
    got, _ = _greedy(model, TurboQuantCache(max_cache_len=64, **settings), _prompt(4), 12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("built", ["lazily", "from_model_config"])
def test_left_padded_generate_equals_dynamic(built):
    """generate() with padding; a cache built from the model's config has its layers before the prefill, so
    generate also builds 4D masks for the prefill from the layers' mask sizes."""
    model = _model("llama_d64_gqa4")
    prompt = _prompt(5, length=36)
    mask = torch.ones_like(prompt)
    prompt[0, :5], mask[0, :5] = 0, 0
    results = []
    config = model.config if built == "from_model_config" else None
    for cache in (TurboQuantCache(**SMALL_WINDOW), TurboQuantCache(config, max_cache_len=CAPACITY, **SMALL_WINDOW)):
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=40, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **cache_kwargs(model, cache))
        results.append(out)
    assert torch.equal(results[0].sequences, results[1].sequences)
    torch.testing.assert_close(torch.stack(results[1].scores), torch.stack(results[0].scores), rtol=0, atol=1e-5)


def test_prefill_in_inference_mode_then_decode_under_no_grad():
    model = _model("llama_d64_gqa4", layers=1)
    want, _ = _greedy(model, TurboQuantCache(max_cache_len=64, **SMALL_WINDOW), _prompt(12), 12)
    cache = TurboQuantCache(max_cache_len=64, **SMALL_WINDOW)
    with torch.inference_mode():
        out = model(_prompt(12), **cache_kwargs(model, cache))
    logits = [out.logits[:, -1].clone()]
    with torch.no_grad():
        for _ in range(12):
            out = model(logits[-1].argmax(-1, keepdim=True), **cache_kwargs(model, cache))
            logits.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(logits), want, rtol=0, atol=0)


def _storage(cache) -> dict[str, int]:
    pointers = {}
    for idx, layer in enumerate(cache.layers):
        tensors = (layer.exact_k, layer.exact_v, *layer.store_tensors, layer.counts, layer.lengths, layer.key_mean,
                   layer.value_mean)
        for j, t in enumerate(tensors):
            if t is not None:
                pointers[f"{idx}.{j}"] = t.data_ptr()
    return pointers


def test_no_allocation_after_prefill_and_reset_keeps_storage():
    model = _model("llama_d64_gqa4")
    cache = TurboQuantCache(max_cache_len=CAPACITY, **SMALL_WINDOW)
    with torch.no_grad():
        model(_prompt(6), **cache_kwargs(model, cache))
    after_prefill, nbytes = _storage(cache), cache.nbytes
    with torch.no_grad():
        token = torch.full((2, 1), 7)
        for _ in range(24):  # 3 blocks compressed
            model(token, **cache_kwargs(model, cache))
    assert _storage(cache) == after_prefill
    assert cache.nbytes == nbytes
    # A new prompt of the same shape after reset() reuses the tensors and gives what a fresh cache gives.
    cache.reset()
    got, _ = _greedy(model, cache, _prompt(7), 10)
    want, _ = _greedy(model, TurboQuantCache(max_cache_len=CAPACITY, **SMALL_WINDOW), _prompt(7), 10)
    assert _storage(cache) == after_prefill
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_step_traces_as_one_graph():
    model = _model("llama_d64_gqa4")
    cache = TurboQuantCache(max_cache_len=CAPACITY, **SMALL_WINDOW)
    with torch.no_grad():
        model(_prompt(8), **cache_kwargs(model, cache))
        explanation = torch._dynamo.explain(model)(torch.full((2, 1), 7), **cache_kwargs(model, cache))
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 3])  # 3: norms after their code rows (store_layout), written by a traced op
def test_compiled_fullgraph_equals_eager_across_rollover(bits):
    """``torch.compile(fullgraph=True)`` of the decode step (aot_eager: the traced graph, without inductor's
    codegen, which the GPU tests cover): the same logits over steps that compress several blocks, no recompile."""
    model = _model("llama_d64_gqa4")
    eager_cache = TurboQuantCache(max_cache_len=CAPACITY, bits=bits, **SMALL_WINDOW)
    eager, _ = _greedy(model, eager_cache, _prompt(9), 24)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    cache = TurboQuantCache(max_cache_len=CAPACITY, bits=bits, **SMALL_WINDOW)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, _ = _greedy(model, cache, _prompt(9), 24, forward=compiled)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-6)
    for layer, eager_layer in zip(cache.layers, eager_cache.layers):  # the same codes and norms in the store
        assert all(torch.equal(a, b) for a, b in zip(layer.store_tensors, eager_layer.store_tensors, strict=True))


def test_generate_would_compile_a_static_cache(caplog):
    """transformers' own criteria: a static TurboQuantCache is compileable (also before its layers are built
    lazily), the dynamic mode is not; on CPU the criteria hold when compile_config asks for every device."""
    model = _model("llama_d64_gqa4")
    static, dynamic = TurboQuantCache(max_cache_len=CAPACITY), TurboQuantCache()
    assert static.is_compileable and not dynamic.is_compileable
    assert TurboQuantCache(model.config, max_cache_len=CAPACITY).is_compileable
    config = transformers.GenerationConfig(compile_config=transformers.CompileConfig())
    config.compile_config._compile_all_devices = True
    with caplog.at_level(logging.WARNING):
        assert model._valid_auto_compile_criteria(cache_kwargs(model, static), config)
        assert not model._valid_auto_compile_criteria(cache_kwargs(model, dynamic), config)
    assert "unable to meet the criteria" in caplog.text  # said for the dynamic cache only
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model._valid_auto_compile_criteria(cache_kwargs(model, static), config)
    assert "unable to meet the criteria" not in caplog.text


def test_refusals_leave_the_cache_unchanged():
    model = _model("llama_d64_gqa4")
    with pytest.raises(ValueError, match="max_cache_len"):
        TurboQuantCache(max_cache_len=0)
    with pytest.raises(ValueError, match="plain codes"):
        TurboQuantCache(max_cache_len=64, bits=3, outlier_channels=8)
    cache = TurboQuantCache(max_cache_len=32, **SMALL_WINDOW)
    with pytest.raises(ValueError, match="more than this static TurboQuantCache's max_cache_len=32"):
        with torch.no_grad():
            model(_prompt(10, length=33), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        model(_prompt(10, length=30), **cache_kwargs(model, cache))
    before = [t.clone() for t in (cache.layers[0].exact_k, cache.layers[0].counts)]
    with pytest.raises(NotImplementedError, match="one token per step"):
        with torch.no_grad():
            model(_prompt(11, length=2), **cache_kwargs(model, cache))
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.layers[0].exact_k, cache.layers[0].counts)))
    with pytest.raises(NotImplementedError, match="cropped"):
        cache.crop(-1)
    with torch.no_grad():
        for _ in range(2):
            model(torch.full((2, 1), 7), **cache_kwargs(model, cache))
        with pytest.raises(ValueError, match="is full"):
            model(torch.full((2, 1), 7), **cache_kwargs(model, cache))
    assert int(cache.get_seq_length()) == 32


@pytest.mark.slow
def test_inductor_writes_inline_norms():
    """Inductor's code for the decode step (CPU) writes the codes and norms of a store whose norms follow their code
    rows (bits=3: one uint8 buffer per side, handed whole to ``flashquant::compress_into``) as eager mode does: the
    same codes, norms within float rounding, the same logits."""
    model = _model("llama_d64_gqa4")
    eager_cache = TurboQuantCache(max_cache_len=CAPACITY, bits=3, **SMALL_WINDOW)
    eager, _ = _greedy(model, eager_cache, _prompt(9), 24)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    cache = TurboQuantCache(max_cache_len=CAPACITY, bits=3, **SMALL_WINDOW)
    got, _ = _greedy(model, cache, _prompt(9), 24, forward=compiled)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-5)
    for layer, eager_layer in zip(cache.layers, eager_cache.layers):
        assert layer.norms_inline == (True, True) and layer.num_compressed >= 32
        k_packed, k_norms, v_packed, v_norms = layer.compressed_views()
        want = eager_layer.compressed_views()
        assert torch.equal(k_packed, want[0]) and torch.equal(v_packed, want[2])
        torch.testing.assert_close(k_norms, want[1], rtol=1e-6, atol=0)  # inductor's centring rounds differently
        torch.testing.assert_close(v_norms, want[3], rtol=1e-6, atol=0)
