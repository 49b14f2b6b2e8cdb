"""Tiny random models of every family the HF integration serves, built in code (nothing downloads), seeded."""

from __future__ import annotations

import functools
import inspect

import torch
import transformers

from flashquant_hf.attention import one_thread  # noqa: F401  (tiny models' decode steps run on one thread)
from flashquant_hf.cache import cache_kwargs  # noqa: F401  (the keyword the installed transformers takes)

VOCAB = 96
PAD = 0

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# family -> (config class, model class, config overrides, attn_implementation)
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "llama_eager": ("LlamaConfig", "LlamaForCausalLM", {}, "eager"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, "sdpa"),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, "sdpa"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "sdpa"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "sdpa"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None, "pad_token_id": PAD}, "sdpa"),
    # Gemma-2 soft-caps its logits, which transformers' sdpa refuses: the model runs eager, as in transformers.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"sliding_window": 8, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0},
        "eager",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2},
        "sdpa",
    ),
}


def _config(family: str, **overrides):
    config_name, _, family_overrides, _ = FAMILIES[family]
    config_cls = getattr(transformers, config_name)
    kwargs = {**_COMMON, **family_overrides, **overrides}
    accepted = inspect.signature(config_cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return config_cls(**kwargs)


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, seed: int = 0, num_hidden_layers: int = 4):
    """A tiny random ``family`` model (eval mode, fp32), seeded; cached per (family, seed, layers)."""
    _, model_name, _, attn = FAMILIES[family]
    torch.manual_seed(seed)
    config = _config(family, num_hidden_layers=num_hidden_layers)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=attn)
    model.eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # generate the full length, whatever the random model says
    return model


def deepseek_v3_config():
    """A tiny DeepSeek-V3 config (multi-head latent attention)."""
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    )


def qwen3_next_config():
    """A tiny Qwen3-Next config (linear-attention layers mixed with full attention)."""
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )


def prompt_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids in [3, VOCAB) of shape [batch, length]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


