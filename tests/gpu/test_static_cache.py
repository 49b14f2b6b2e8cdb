"""The static mode on the GPU: ``TurboQuantCache(max_cache_len=N)`` compiled (inductor, CUDA graphs) against the
same cache eager, with the kernels; ``generate`` compiles it by itself."""

import logging

import pytest
import torch
import transformers

from flashquant_hf import TurboQuantCache
from flashquant_hf.cache import cache_kwargs

PROMPT = 300
STEPS = 64
# Small windows so that 64 decode steps leave the window several times (a block every 16 steps).
SETTINGS = {
    4: dict(bits=4, residual_length=32, window_block=16),
    3: dict(bits=3, residual_length=32, window_block=16),
    2.5: dict(bits=2.5, residual_length=32, window_block=16),
}
MODELS = {
    "llama_d64_gqa4": ("LlamaConfig", "LlamaForCausalLM", 64),
    "llama_d128_gqa4": ("LlamaConfig", "LlamaForCausalLM", 128),
    "qwen3_d128_gqa4": ("Qwen3Config", "Qwen3ForCausalLM", 128),
}


def _model(name: str, dtype=torch.float32) -> transformers.PreTrainedModel:
    config_name, model_name, head_dim = MODELS[name]
    config = getattr(transformers, config_name)(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation="sdpa")
    model = model.to("cuda", dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # the full length, whatever the random model says
    return model


def _prompt(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 512, (batch, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


@torch.no_grad()
def _decode(model, cache, prompt, steps, forward=None, tokens=None):
    """Last-position logits of the prefill and of every step, [steps + 1, B, V] fp32. Each step feeds the greedy
    token of the previous logits, or ``tokens[i]`` ([steps, B]) when given (teacher forcing)."""
    forward = forward if forward is not None else model
    out = model(prompt, **cache_kwargs(model, cache))
    logits = [out.logits[:, -1].float()]
    for i in range(steps):
        token = logits[-1].argmax(-1) if tokens is None else tokens[i]
        logits.append(forward(token[:, None], **cache_kwargs(model, cache)).logits[:, -1].float().clone())
    return torch.stack(logits)


@pytest.fixture(autouse=True)
def _cuda_backend(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    torch._dynamo.reset()


@pytest.mark.parametrize("name, bits", [(name, 4) for name in MODELS] + [("llama_d128_gqa4", 3),
                                                                          ("llama_d128_gqa4", 2.5)])
def test_generate_compiled_equals_eager(name, bits, caplog):
    """generate() auto-compiles a static cache (no 'unable to meet the criteria' warning) and gives the eager
    static cache's greedy tokens over 64 steps (fp32: the same kernels; inductor changes only the torch ops'
    rounding)."""
    model = _model(name)
    prompt = _prompt(1)
    kwargs = dict(max_new_tokens=STEPS, do_sample=False)
    settings = SETTINGS[bits]
    capacity = PROMPT + STEPS
    static = TurboQuantCache(max_cache_len=capacity, **settings)
    assert model._valid_auto_compile_criteria(cache_kwargs(model, static), model.generation_config)
    with caplog.at_level(logging.WARNING):
        compiled = model.generate(prompt, **cache_kwargs(model, static), **kwargs)
    assert "unable to meet the criteria" not in caplog.text
    assert hasattr(model, "_compiled_call"), "generate did not compile the forward"
    eager = model.generate(prompt, **cache_kwargs(model, TurboQuantCache(max_cache_len=capacity, **settings)),
                           disable_compile=True, **kwargs)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("bits", list(SETTINGS))
def test_static_matches_dynamic_mode(bits):
    """The same tokens fed to the static and the dynamic mode (the decode plans differ: capacity vs length)."""
    model = _model("llama_d128_gqa4")
    tokens = torch.randint(3, 512, (STEPS, 2), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    static = _decode(model, TurboQuantCache(max_cache_len=PROMPT + STEPS, **SETTINGS[bits]), _prompt(6), STEPS,
                     tokens=tokens)
    dynamic = _decode(model, TurboQuantCache(**SETTINGS[bits]), _prompt(6), STEPS, tokens=tokens)
    rel = ((static - dynamic).norm() / dynamic.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("name", ["llama_d128_gqa4"])
def test_fullgraph_has_no_graph_break(name):
    model = _model(name, torch.bfloat16)
    cache = TurboQuantCache(max_cache_len=PROMPT + 8, **SETTINGS[4])
    with torch.no_grad():
        model(_prompt(2), **cache_kwargs(model, cache))
        explanation = torch._dynamo.explain(model)(torch.full((2, 1), 7, device="cuda"), **cache_kwargs(model, cache))
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("bits", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_after_rollover_matches_eager(bits, dtype):
    """torch.compile(fullgraph=True, mode='reduce-overhead'): the decode step is replayed as a CUDA graph (no
    cudagraph skip, no recompile) through 64 steps that compress 4 blocks; fed the eager run's greedy tokens, it
    gives the eager static cache's logits (fp32: and its greedy tokens)."""
    model = _model("llama_d128_gqa4", dtype)
    settings, capacity = SETTINGS[bits], PROMPT + STEPS
    eager = _decode(model, TurboQuantCache(max_cache_len=capacity, **settings), _prompt(3), STEPS)
    tokens = eager[:-1].argmax(-1)
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decode(model, TurboQuantCache(max_cache_len=capacity, **settings), _prompt(3), STEPS, compiled,
                      tokens=tokens)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    if dtype == torch.float32:
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
    rel = ((got - eager).norm() / eager.norm()).item()
    assert rel < (1e-4 if dtype == torch.float32 else 2e-2), rel


def test_kernel_path_matches_reference_path(monkeypatch):
    """The static mode's kernels (decode with device lengths, compression into the store) against its PyTorch
    reference on the same GPU."""
    model = _model("llama_d128_gqa4")
    capacity = PROMPT + STEPS
    tokens = torch.randint(3, 512, (32, 2), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    fast = _decode(model, TurboQuantCache(max_cache_len=capacity, **SETTINGS[4]), _prompt(4), 32, tokens=tokens)
    monkeypatch.setenv("FLASHQUANT_BACKEND", "torch")
    ref = _decode(model, TurboQuantCache(max_cache_len=capacity, **SETTINGS[4]), _prompt(4), 32, tokens=tokens)
    rel = ((fast - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


def test_storage_is_fixed_after_prefill():
    model = _model("llama_d64_gqa4", torch.bfloat16)
    cache = TurboQuantCache(max_cache_len=PROMPT + STEPS, **SETTINGS[4])
    with torch.no_grad():
        model(_prompt(5), **cache_kwargs(model, cache))
    pointers = [t.data_ptr() for layer in cache.layers for t in (layer.exact_k, *layer.store_tensors, layer.counts)]
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(STEPS):
            compiled(torch.full((2, 1), 7, device="cuda"), **cache_kwargs(model, cache))
    assert pointers == [t.data_ptr() for layer in cache.layers for t in (layer.exact_k, *layer.store_tensors,
                                                                          layer.counts)]
    assert int(cache.get_seq_length()) == PROMPT + STEPS
