"""What flashquant registers in transformers' attention interfaces, and how to undo it.

transformers (5.17 - 5.25) calls ``cache.update(k, v, layer_idx)`` and then the function registered under
``config._attn_implementation`` with whatever ``update`` returned; the attention function never sees the cache.
So ``TurboQuantLayer.update`` tags the tensors it returns (:mod:`flashquant_hf.tags`) and :func:`install` wraps
every registered attention function: a tensor tagged with a :class:`~flashquant_hf.tags.CompressedPlan` goes to
:func:`~flashquant_hf.attention.compressed_attention` when the model uses ``sdpa``/``eager`` (so a model loaded the
ordinary way needs no change) and raises a clear error under any other implementation; untagged tensors go to the
original function. ``attn_implementation="turboquant"`` is registered too (attention and mask interfaces). It is
not called "flashquant": transformers treats every implementation name containing "flash" as FlashAttention
(``is_flash_attention_requested``) and would hand it 2D masks and FlashAttention kernels.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable

import torch

from .attention import compressed_attention, exact_attention, to_model_layout
from .log import warn_once
from .masks import bias_from, causal_visible, mask_to_bias
from .tags import TAG, CompressedPlan, FirstPrefillTag

logger = logging.getLogger(__name__)

NAME = "turboquant"  # no "flash" in it: see the module docstring
ROUTED = ("sdpa", "eager")  # implementations whose compressed calls are served by the flashquant attention
# Attention arguments that change the math and that the compressed path does not implement.
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask")

_originals: dict[str, Callable | None] = {}


# --------------------------------------------------------------------------------------------- serving calls
def _check_compressed_call(name: str, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout:
        raise ValueError(f"the flashquant attention is inference-only, got `dropout={dropout}` (call model.eval())")
    for key in UNSUPPORTED_KWARGS:
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"the flashquant attention does not support the attention argument `{key}` (passed by this model "
                f"under {name!r}); TurboQuantCache cannot serve it"
            )
    if kwargs.get("output_attentions"):
        warn_once(logger, "flashquant: `output_attentions` is not supported; attention weights are None")


def _serve_compressed(module, query, plan, attention_mask, name, dropout=0.0, scaling=None, softcap=None,
                      is_causal=None, **kwargs):
    _check_compressed_call(name, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cache = plan.layer._cache_ref() if plan.layer._cache_ref is not None else None
    if cache is not None:
        cache.announce(name)
    with torch.no_grad():  # inference-only; also lets cached rotations made under inference_mode be used
        out = compressed_attention(plan, query, attention_mask, scaling=scaling, softcap=softcap, is_causal=causal)
    return out, None


def _adopt(module, tag: FirstPrefillTag, key: torch.Tensor, value: torch.Tensor) -> None:
    """First prefill of a layer: let a cache built without model_config learn the model's layer types."""
    cache = tag.layer._cache_ref() if tag.layer._cache_ref is not None else None
    config = getattr(module, "config", None)
    if cache is not None and config is not None and hasattr(config, "get_text_config"):
        cache.adopt_model_config(config, tag.layer.layer_idx, key, value)


def _model_eager(module) -> Callable:
    """The model's own eager attention (what transformers falls back to for ``"eager"``)."""
    forward = getattr(type(module), "forward", None)
    forward = inspect.unwrap(forward) if forward is not None else None  # past transformers' decorators
    fn = getattr(forward, "__globals__", {}).get("eager_attention_forward")
    if fn is None:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(
            f"flashquant could not find the eager attention of {type(module).__name__}; "
            "load the model with attn_implementation='sdpa'"
        )
    return fn


def _sdpa_or_exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Exact attention for untagged K/V under ``"turboquant"``: transformers' sdpa, or torch for soft-capping."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, _, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    bias = mask_to_bias(attention_mask, batch, q_len, kv_len)
    is_causal = kwargs.get("is_causal")
    if bias is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        bias = bias_from(causal_visible(q_len, kv_len, kv_len - q_len, query.device))[None]
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    out, _ = exact_attention(query, key, value, bias, scale, softcap)
    return to_model_layout(out, query.dtype), None


def flashquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``attn_implementation="turboquant"``: the compressed attention for tagged K/V, exact attention otherwise.

    query : shape [B, Hq, Lq, D]; key/value : what the cache's ``update`` returned; returns
    (attn_output [B, Lq, Hq, D], None).
    """
    tag = getattr(key, TAG, None)
    if isinstance(tag, CompressedPlan):
        return _serve_compressed(module, query, tag, attention_mask, NAME, dropout, scaling, softcap, **kwargs)
    if isinstance(tag, FirstPrefillTag):
        _adopt(module, tag, key, value)
    return _sdpa_or_exact(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)


def _routing(name: str, original: Callable | None) -> Callable:
    """Wrap the attention function registered as ``name``: compressed K/V -> flashquant (or an error)."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        tag = getattr(key, TAG, None)
        if isinstance(tag, CompressedPlan):
            if name not in ROUTED:
                raise NotImplementedError(
                    f"TurboQuantCache needs the attention implementation 'sdpa', 'eager' or 'turboquant', but this "
                    f"model uses {name!r}: load it with attn_implementation='sdpa' or call "
                    "model.set_attn_implementation('sdpa')"
                )
            return _serve_compressed(module, query, tag, attention_mask, name, *args, **kwargs)
        if isinstance(tag, FirstPrefillTag):
            _adopt(module, tag, key, value)
        target = original if original is not None else _model_eager(module)
        return target(module, query, key, value, attention_mask, *args, **kwargs)

    attention._flashquant_original = original
    attention.__name__ = f"flashquant_routed_{name.replace('|', '_')}"
    return attention


# --------------------------------------------------------------------------------------------- (un)registering
def install() -> None:
    """Register ``"turboquant"`` and route every registered attention function through the TurboQuant check.

    Idempotent. Functions registered after this call are wrapped by the next call (every new TurboQuantCache
    calls it).
    """
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    AttentionInterface.register(NAME, flashquant_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for name, fn in list(mapping.items()):
        if name == NAME or hasattr(fn, "_flashquant_original"):
            continue
        _originals[name] = fn
        AttentionInterface.register(name, _routing(name, fn))
    if "eager" not in mapping:
        _originals["eager"] = None
        AttentionInterface.register("eager", _routing("eager", None))


def uninstall() -> None:
    """Restore the attention functions replaced by :func:`install` and drop ``"turboquant"``."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name, fn in _originals.items():
        if fn is None:
            mapping.pop(name, None)
        else:
            mapping[name] = fn
    _originals.clear()
    mapping.pop(NAME, None)
    AttentionMaskInterface._global_mapping.pop(NAME, None)
