"""What flashquant registers in transformers' attention interfaces, and how to undo it.

transformers (5.17 - 5.25) calls ``cache.update(k, v, layer_idx)`` and then the function registered under
``config._attn_implementation`` with whatever ``update`` returned; the attention function never sees the cache.
So ``TurboQuantLayer.update`` tags the tensors it returns (:mod:`flashquant_hf.tags`) and :func:`install`
wraps the implementations it routes (:data:`ROUTED`: ``sdpa`` and ``eager``, so a model loaded the ordinary way
needs no change): a tensor tagged with a :class:`~flashquant_hf.tags.CompressedPlan` goes to
:func:`~flashquant_hf.attention.compressed_attention`, anything else to the original function. It also registers
``attn_implementation="turboquant"`` (attention and mask interfaces). That name is not "flashquant": transformers
treats every implementation name containing "flash" as FlashAttention (``is_flash_attention_requested``) and
would hand it 2D masks and FlashAttention kernels. Other implementations are left alone; a layer whose
compressed K/V reached one of them raises at its next ``update``.

Every TurboQuantCache calls :func:`install` (idempotent); :func:`uninstall` puts back every entry it replaced.
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
from .static_attention import static_decode_attention
from .tags import TAG, CompressedPlan, FirstPrefillTag, StaticPlan

logger = logging.getLogger(__name__)

NAME = "turboquant"  # no "flash" in it: see the module docstring
ROUTED = ("sdpa", "eager")  # implementations whose compressed calls are served by the flashquant attention
# Attention arguments that change the math and that the compressed path does not implement.
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask")

_MISSING = object()
# (interface, name) -> (the entry before install, the entry install put there); what uninstall() restores.
_replaced: dict[tuple[str, str], tuple[Any, Callable]] = {}


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


def _serve_static(module, query, plan, attention_mask, name, dropout=0.0, scaling=None, softcap=None, **kwargs):
    _check_compressed_call(name, dropout, kwargs)
    with torch.no_grad():
        out = static_decode_attention(plan.layer, query, attention_mask, scaling=scaling, softcap=softcap)
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
    if isinstance(tag, StaticPlan):
        return _serve_static(module, query, tag, attention_mask, NAME, dropout, scaling, softcap, **kwargs)
    if isinstance(tag, CompressedPlan):
        return _serve_compressed(module, query, tag, attention_mask, NAME, dropout, scaling, softcap, **kwargs)
    if isinstance(tag, FirstPrefillTag):
        _adopt(module, tag, key, value)
    return _sdpa_or_exact(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)


def _routing(name: str, original: Callable | None) -> Callable:
    """Wrap the attention function registered as ``name`` (one of :data:`ROUTED`; None: the model's own eager):
    compressed K/V go to the flashquant attention, everything else to ``original``."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        tag = getattr(key, TAG, None)
        if isinstance(tag, StaticPlan):
            return _serve_static(module, query, tag, attention_mask, name, *args, **kwargs)
        if isinstance(tag, CompressedPlan):
            return _serve_compressed(module, query, tag, attention_mask, name, *args, **kwargs)
        if isinstance(tag, FirstPrefillTag):
            _adopt(module, tag, key, value)
        target = original if original is not None else _model_eager(module)
        return target(module, query, key, value, attention_mask, *args, **kwargs)

    attention._flashquant_original = original
    attention.__name__ = f"flashquant_routed_{name}"
    return attention


# --------------------------------------------------------------------------------------------- (un)registering
def _interfaces() -> dict[str, dict[str, Any]]:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return {"attention": AttentionInterface._global_mapping, "mask": AttentionMaskInterface._global_mapping}


def _put(mappings: dict[str, dict[str, Any]], interface: str, name: str, entry: Callable) -> None:
    mapping = mappings[interface]
    _replaced[(interface, name)] = (mapping.get(name, _MISSING), entry)
    mapping[name] = entry


def _is_ours(mappings: dict[str, dict[str, Any]], interface: str, name: str) -> bool:
    record = _replaced.get((interface, name))
    return record is not None and mappings[interface].get(name, _MISSING) is record[1]


def install() -> None:
    """Register ``"turboquant"`` (attention and mask interfaces) and route :data:`ROUTED` through the TurboQuant
    check. Idempotent; a routed function registered again by someone else since is wrapped anew."""
    from transformers.masking_utils import sdpa_mask

    mappings = _interfaces()
    if not _is_ours(mappings, "attention", NAME):
        _put(mappings, "attention", NAME, flashquant_attention_forward)
    if not _is_ours(mappings, "mask", NAME):
        _put(mappings, "mask", NAME, sdpa_mask)
    for name in ROUTED:
        if not _is_ours(mappings, "attention", name):
            _put(mappings, "attention", name, _routing(name, mappings["attention"].get(name)))


def uninstall() -> None:
    """Undo :func:`install`: every entry it registered that is still there goes back to what it replaced (or is
    removed when there was none). Compressed K/V served afterwards reach the original functions, and the next
    ``update`` of their layer raises; a new TurboQuantCache installs again."""
    mappings = _interfaces()
    for (interface, name), (before, _) in list(_replaced.items()):
        if _is_ours(mappings, interface, name):
            if before is _MISSING:
                del mappings[interface][name]
            else:
                mappings[interface][name] = before
    _replaced.clear()
