"""TurboQuantCache on the GPU: the kernels path agrees with the PyTorch reference path and with DynamicCache."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flashquant_hf import TurboQuantCache, log
from flashquant_hf.cache import cache_kwargs


def _tiny_llama(head_dim: int) -> LlamaForCausalLM:
    torch.manual_seed(torch.randint(0, 2**30, ()).item())
    config = LlamaConfig(
        vocab_size=512, hidden_size=4 * head_dim, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@torch.no_grad()
def _teacher_forced_logits(model, ids, prefix, cache):
    out = model(ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
    logits = [out.logits[:, -1].float()]
    for t in range(prefix, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("residual_length", [0, 16])
def test_kernel_path_matches_reference_path(monkeypatch, head_dim, residual_length):
    """Same compressed cache contents, attention by the CUDA kernels vs the PyTorch reference on the GPU."""
    model = _tiny_llama(head_dim)
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    fast = _teacher_forced_logits(model, ids, 200, TurboQuantCache(residual_length=residual_length))
    monkeypatch.setenv("FLASHQUANT_BACKEND", "torch")
    ref = _teacher_forced_logits(model, ids, 200, TurboQuantCache(residual_length=residual_length))
    assert not fast.isnan().any()
    rel = ((fast - ref).norm() / ref.norm()).item()
    print(f"head_dim={head_dim} R={residual_length} rel={rel:.2e}")
    assert rel < 2e-2


def test_generate_equals_dynamic_cache_while_everything_is_exact(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    model = _tiny_llama(128)
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    ours = model.generate(ids, **cache_kwargs(model, TurboQuantCache(residual_length=1024)), **kwargs)
    theirs = model.generate(ids, **cache_kwargs(model, DynamicCache()), **kwargs)
    assert torch.equal(ours, theirs)


def test_compressed_generate_runs_on_kernels(monkeypatch):
    """Every token compressed: generation runs end to end through the kernels and stays close to bf16 greedy."""
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    model = _tiny_llama(128)
    ids = torch.randint(0, 512, (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    cache = TurboQuantCache(residual_length=0)
    # min_new_tokens: the random model's greedy token may be its eos id, which would end generation early.
    out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 80)
    assert cache.get_seq_length() == 79


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [4, 3, 2.5])
def test_presets_with_sinks_and_centring_run_on_kernels(monkeypatch, caplog, head_dim, bits):
    """The quality defaults (sinks, key centring) and the 3 / 2.5-bit presets: no fallback, same as reference."""
    monkeypatch.setattr(log, "_warned", set())  # every fallback or slow path would be logged again
    model = _tiny_llama(head_dim)
    ids = torch.randint(0, 512, (2, 260), device="cuda")
    settings = dict(bits=bits, residual_length=16, sink_tokens=4, key_centering=True)
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    with caplog.at_level("WARNING", logger="flashquant_hf"):
        fast = _teacher_forced_logits(model, ids, 200, TurboQuantCache(**settings))
    assert not [r for r in caplog.records if "flashquant" in r.getMessage()], caplog.text
    monkeypatch.setenv("FLASHQUANT_BACKEND", "torch")
    ref = _teacher_forced_logits(model, ids, 200, TurboQuantCache(**settings))
    assert not fast.isnan().any()
    rel = ((fast - ref).norm() / ref.norm()).item()
    print(f"bits={bits} head_dim={head_dim} rel={rel:.2e}")
    assert rel < 2e-2


@pytest.mark.parametrize("levers", [dict(bits=3, outlier_channels=32), dict(bits=4, key_qjl=True)])
def test_split_codes_run_on_the_reference_with_a_warning(monkeypatch, caplog, levers):
    """Outlier channels / QJL residual on CUDA tensors: served by the PyTorch reference, said once, same logits."""
    monkeypatch.setattr(log, "_warned", set())
    model = _tiny_llama(128)
    ids = torch.randint(0, 512, (2, 160), device="cuda")
    settings = dict(residual_length=16, **levers)
    monkeypatch.setenv("FLASHQUANT_BACKEND", "cuda")
    with caplog.at_level("WARNING", logger="flashquant_hf"):
        fast = _teacher_forced_logits(model, ids, 120, TurboQuantCache(**settings))
    warnings = [r for r in caplog.records if "PyTorch reference" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    monkeypatch.setenv("FLASHQUANT_BACKEND", "torch")
    ref = _teacher_forced_logits(model, ids, 120, TurboQuantCache(**settings))
    assert not fast.isnan().any()
    assert ((fast - ref).norm() / ref.norm()).item() < 2e-2
