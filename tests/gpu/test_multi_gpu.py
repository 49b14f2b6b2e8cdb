"""TurboQuantCache on a model spread over two GPUs: accelerate's ``device_map="auto"`` (whole decoder
layers on different GPUs) and transformers tensor parallelism (``tp_plan="auto"``, two NCCL ranks under
torchrun). Skipped on machines with fewer than two GPUs; the CPU suite runs the tensor-parallel checks on gloo
ranks (tests/test_tensor_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tp_worker
import transformers
from transformers import DynamicCache

from flashquant_hf import TurboQuantCache
from flashquant_hf.cache import cache_kwargs

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

STEPS = 64
LLAMA = dict(
    vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> tuple[Path, int]:
    """The random model saved once: (its directory, its parameter count)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    path = tmp_path_factory.mktemp("multi_gpu") / "model"
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def model_dir(saved_model) -> Path:
    return saved_model[0]


def _prompt(batch: int = 2, length: int = 80, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, LLAMA["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, prompt: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    model.generation_config.eos_token_id = None
    out = model.generate(prompt.to(model.device), **cache_kwargs(model, cache), max_new_tokens=STEPS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits, 1).float().cpu()


def _split_model(saved_model: tuple[Path, int]):
    model_dir, params = saved_model
    weights = 2 * params  # bf16 bytes
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="auto", max_memory={0: int(0.55 * weights), 1: 4 * weights})
    devices = {torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in model.hf_device_map.values()}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}, model.hf_device_map
    return model


def test_device_map_split_with_exact_window_equals_dynamic_cache(saved_model):
    model = _split_model(saved_model)
    prompt = _prompt()
    assert torch.equal(_generate(model, prompt, TurboQuantCache(residual_length=10_000))[0],
                       _generate(model, prompt, DynamicCache())[0])


def test_device_map_split_compressed_matches_one_gpu_and_keeps_each_layer_on_its_device(saved_model):
    model_dir = saved_model[0]
    split = _split_model(saved_model)
    prompt = _prompt()
    cache = TurboQuantCache(residual_length=0, sink_tokens=0)
    seq, logits = _generate(split, prompt, cache)
    for layer, block in zip(cache.layers, split.model.layers):
        assert layer.device == block.self_attn.q_proj.weight.device
    one = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
    one_seq, one_logits = _generate(one, prompt, TurboQuantCache(residual_length=0, sink_tokens=0))
    assert torch.equal(seq, one_seq)
    torch.testing.assert_close(logits, one_logits, rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def tp_results(model_dir, tmp_path_factory):
    runner = tp_worker.torchrun()
    if runner is None:
        pytest.skip("torchrun is not installed")
    prompt = _prompt(batch=1)
    return prompt, tp_worker.launch(runner, model_dir, prompt, STEPS, tmp_path_factory.mktemp("tp_gpu"), "cuda",
                                    timeout=600)


def test_tp_ranks_cache_their_own_kv_heads_and_exact_window_equals_dynamic_cache(tp_results):
    _, results = tp_results
    assert results["exact_window_kv_heads"] == results["compressed_kv_heads"] == LLAMA["num_key_value_heads"] // 2
    assert torch.equal(results["exact_window"][0], results["dynamic"][0])


def test_tp_compressed_logits_match_one_gpu(model_dir, tp_results):
    prompt, results = tp_results
    one = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0")
    seq, logits = _generate(one, prompt, TurboQuantCache(residual_length=0, sink_tokens=0))
    tp_seq, tp_logits = results["compressed"]
    assert torch.equal(tp_seq, seq)
    torch.testing.assert_close(tp_logits.float(), logits, rtol=2e-2, atol=2e-2)
