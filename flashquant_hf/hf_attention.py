"""The attention over a TurboQuantLayer, and its registration in transformers' attention interfaces.

transformers (5.17 - 5.24) calls ``cache.update(k, v, layer_idx)`` and then the function registered under
``config._attn_implementation`` with whatever ``update`` returned; the attention function never sees the cache.
So ``TurboQuantLayer.update`` tags the tensors it returns (attribute ``_flashquant``) and :func:`install` wraps
every registered attention function: a tensor tagged with a :class:`~flashquant_hf.cache.CompressedPlan` goes to
:func:`compressed_attention` when the model uses ``sdpa``/``eager`` (so a model loaded the ordinary way needs no
change) and raises a clear error under any other implementation; untagged tensors go to the original function.
``attn_implementation="turboquant"`` is registered too (attention and mask interfaces). It is not called
"flashquant": transformers treats every implementation name containing "flash" as FlashAttention
(``is_flash_attention_requested``) and would hand it 2D masks and FlashAttention kernels.

The compressed-path algorithm (one call, ``Lq`` queries, the layer holding ``S`` sinks, ``Nc`` compressed and
``W`` window tokens; queries are the last ``Lq`` positions):

1. ``q_rot = q @ Pi_K.T`` once; ``ops.tq_attention`` over the compressed part. With causal masking the first
   ``Lq - W`` queries (if any) see the compressed part bottom-right-causally, the others see all of it; padding
   comes from the 4D mask as a per-key bias. Key centring shifts every compressed score of one query by
   ``scale * q . mu_k``: added to that part's log-sum-exp.
2. ``out_c @ Pi_V`` once (+ ``mu_v`` with value centring).
3. The exact parts (sinks and window) attended in torch with their own log-sum-exp, then ``ops.merge_partials``.

A mask that is not "causal structure + per-key bias" (a custom 4D mask, a sliding window over a compressed
layer during a multi-token chunk), soft-capping (Gemma-2) and split codes (outlier channels, QJL residual;
:mod:`flashquant_hf.codec`) take an exact torch path instead (correct, slower: the codecs rebuild the compressed
K/V in their rotated spaces).
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable

import torch

from .cache import TAG, CompressedPlan, FirstPrefillTag, TurboQuantLayer
from .ops import implementation

logger = logging.getLogger(__name__)

NAME = "turboquant"  # no "flash" in it: see the module docstring
ROUTED = ("sdpa", "eager")  # implementations whose compressed calls are served by the flashquant attention
# Attention arguments that change the math and that the compressed path does not implement.
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias", "head_mask")
ROW_BLOCK = 256  # query rows per block when a multi-token chunk's mask is checked
TORCH_ROWS = 64  # query rows per block of the torch path (its scores are [B, Hq, rows, Nc] fp32)

_originals: dict[str, Callable | None] = {}
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


# --------------------------------------------------------------------------------------------- masks
def check_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """The 4D mask as ``[B or 1, Lq, kv_len]`` (a view), after checking its shape; None stays None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"the flashquant attention takes a 4D tensor mask or None, got {type(attention_mask).__name__}"
        )
    shape = list(attention_mask.shape)
    if (
        attention_mask.dim() != 4
        or shape[0] not in (1, batch)
        or shape[1] != 1
        or shape[2] != q_len
        or shape[3] != kv_len
    ):
        raise ValueError(
            f"`attention_mask` must have shape [{batch} or 1, 1, {q_len}, {kv_len}] (queries x every cached token); "
            f"got {shape} (per-head masks are not supported)"
        )
    return attention_mask[:, 0]


def as_bias(mask: torch.Tensor) -> torch.Tensor:
    """An additive fp32 bias (0 where visible, -inf where masked) from a mask slice.

    Boolean masks (sdpa) mark visible keys with True; float masks (eager) are additive, with values at or
    below half the dtype's minimum meaning "masked".
    """
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float().masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))


def mask_to_bias(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """:func:`as_bias` of the whole checked mask, ``[B, Lq, kv_len]`` fp32 (tests and small masks)."""
    mask = check_mask(attention_mask, batch, q_len, kv_len)
    return None if mask is None else as_bias(mask).expand(batch, q_len, kv_len)


def _causal(q_len: int, kv_len: int, diagonal: int, device: torch.device) -> torch.Tensor:
    """Bool ``[q_len, kv_len]``: query i sees key j iff ``j <= diagonal + i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + diagonal
    return torch.arange(kv_len, device=device).unsqueeze(0) <= rows


def _bias_from(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


# --------------------------------------------------------------------------------------------- exact parts
def exact_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over exact K/V in fp32 with its log-sum-exp.

    Parameters
    ----------
    query : shape [B, Hq, Lq, D]
    keys, values : shape [B, H_kv, N, D] (Hq a multiple of H_kv)
    bias : fp32 shape [B, Lq, N] additive (-inf masked), or None
    scale, softcap : as in the model (scores are ``softcap * tanh(scale * q.k / softcap)`` when soft-capped)

    Returns
    -------
    out : fp32 shape [B, Hq, Lq, D] (0 for a row that sees nothing); lse : fp32 shape [B, Hq, Lq]
    """
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group * q_len, head_dim)
    scores = (q @ keys.float().transpose(-1, -2)).view(batch, kv_heads, group, q_len, kv_len) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias[:, None, None]
    return _softmax_out(scores, values.float(), q_heads, masked=bias is not None or kv_len == 0)


def _softmax(scores: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, log-sum-exp) over the last dim; rows that see nothing get probabilities 0 and lse -inf.

    ``masked=False`` promises that no score is -inf (every row sees every key): fewer kernels per decode step.
    """
    lse = torch.logsumexp(scores, dim=-1)
    if not masked:
        return torch.exp(scores - lse.unsqueeze(-1)), lse
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0).unsqueeze(-1))
    return torch.where(finite.unsqueeze(-1), probs, 0), lse


def _softmax_out(
    scores: torch.Tensor, values: torch.Tensor, q_heads: int, masked: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, H_kv, G, Lq, N], values [B, H_kv, N, D] -> (out [B, Hq, Lq, D], lse [B, Hq, Lq])."""
    batch, kv_heads, group, q_len, kv_len = scores.shape
    probs, lse = _softmax(scores, masked)
    out = probs.view(batch, kv_heads, group * q_len, kv_len) @ values
    return out.view(batch, q_heads, q_len, -1), lse.reshape(batch, q_heads, q_len)


def _to_model_layout(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hq, Lq, D] -> a new contiguous [B, Lq, Hq, D] in ``dtype`` (one copy kernel)."""
    batch, q_heads, q_len, head_dim = out.shape
    result = torch.empty((batch, q_len, q_heads, head_dim), dtype=dtype, device=out.device)
    return result.copy_(out.transpose(1, 2))


# --------------------------------------------------------------------------------------------- compressed part
def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, Lq, D] -> [B, H_kv, G, Lq, D] (query head h uses KV head h // G)."""
    batch, q_heads, q_len, head_dim = x.shape
    return x.reshape(batch, kv_heads, q_heads // kv_heads, q_len, head_dim)


def _compressed_fast(
    layer: TurboQuantLayer,
    query: torch.Tensor,
    key_bias: torch.Tensor | None,
    first_causal_rows: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.tq_attention over the compressed part: (out [B, Hq, Lq, D] fp32 in model space, lse incl. centring)."""
    dev = query.device
    tq_k, tq_v = layer.key_codec.quantizer, layer.value_codec.quantizer
    kp, kn, vp, vn = layer.compressed_views()
    q_rot = (query.float() @ tq_k.rotation(dev).T).to(query.dtype)
    impl = implementation("tq_attention", q_rot, kp, backend=layer.config.backend)
    args = (kp, kn, vp, vn, tq_k.centroids(dev), tq_v.centroids(dev), tq_k.bits, tq_v.bits, scale)
    outs, lses = [], []
    q_len = query.shape[2]
    for rows, causal in ((slice(0, first_causal_rows), True), (slice(first_causal_rows, q_len), False)):
        if rows.stop > rows.start:
            q_rows = q_rot[:, :, rows].contiguous()
            try:
                out, lse = impl.tq_attention(q_rows, *args, causal=causal, key_bias=key_bias)
            except NotImplementedError as error:  # a kernel without this specialisation (e.g. 3-bit decode)
                _warn_once(f"fallback-{error}", f"flashquant: {error}; using the PyTorch reference tq_attention")
                impl = implementation("tq_attention", backend="torch")
                out, lse = impl.tq_attention(q_rows, *args, causal=causal, key_bias=key_bias)
            outs.append(out)
            lses.append(lse)
    out_rot = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    out = out_rot.float() @ tq_v.rotation(dev)
    return _uncenter(layer, query, out, lse.float(), scale)


def _compressed_torch(
    layer: TurboQuantLayer,
    query: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path over the compressed part, any code (bias fp32 [B, Lq, Nc]). The codecs multiply in their rotated
    spaces, so the compressed K/V are never rebuilt in model space; long chunks run in blocks of TORCH_ROWS query
    rows so their scores are never all held at once."""
    if query.shape[2] > TORCH_ROWS:
        parts = []
        for r0 in range(0, query.shape[2], TORCH_ROWS):
            rows = slice(r0, r0 + TORCH_ROWS)
            parts.append(_compressed_torch(layer, query[:, :, rows], bias[:, rows], scale, softcap))
        return torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = layer.num_heads
    q = query.float().reshape(batch, kv_heads, -1, head_dim)
    scores = layer.key_codec.dot(q, layer.key_views(), layer.key_order)
    scores = scores.view(batch, kv_heads, q_heads // kv_heads, q_len, -1)
    if layer.key_mean is not None:
        q_mu = (_grouped(query.float(), kv_heads) * layer.key_mean[:, :, None, None, :]).sum(-1)
        scores = scores + q_mu.unsqueeze(-1)
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias[:, None, None]
    probs, lse = _softmax(scores)
    out = layer.value_codec.weighted_sum(probs.view(batch, kv_heads, -1, probs.shape[-1]), layer.value_views(),
                                         layer.value_order)
    out = out.view(batch, q_heads, q_len, head_dim)
    if layer.value_mean is not None:
        out = (_grouped(out, kv_heads) + layer.value_mean[:, :, None, None, :]).reshape(out.shape)
    return out, lse.reshape(batch, q_heads, q_len)


def _uncenter(
    layer: TurboQuantLayer, query: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo key/value centring on a compressed part's (out, lse)."""
    kv_heads = layer.num_heads
    if layer.key_mean is not None:
        q_mu = (_grouped(query.float(), kv_heads) * layer.key_mean[:, :, None, None, :]).sum(-1)
        lse = lse + scale * q_mu.reshape(lse.shape)
    if layer.value_mean is not None:
        out = (_grouped(out, kv_heads) + layer.value_mean[:, :, None, None, :]).reshape(out.shape)
    return out, lse


def _is_regular(mask: torch.Tensor, cols: slice, key_bias: torch.Tensor, diagonal: int | None) -> bool:
    """Whether every row of ``mask[:, :, cols]`` is ``key_bias`` restricted by the causal structure.

    ``diagonal``: query i sees compressed key j iff ``j <= diagonal + i`` (None: no causal structure). Checked in
    blocks of rows so a long chunk never materialises a float copy of the whole mask block.
    """
    q_len, n_keys = mask.shape[1], cols.stop - cols.start
    for r0 in range(0, q_len, ROW_BLOCK):
        r1 = min(q_len, r0 + ROW_BLOCK)
        block = as_bias(mask[:, r0:r1, cols])
        expected = key_bias[: block.shape[0], None, :].expand(block.shape[0], r1 - r0, n_keys)
        if diagonal is not None:
            expected = expected.masked_fill(~_causal(r1 - r0, n_keys, diagonal + r0, mask.device), float("-inf"))
        if not torch.equal(block, expected):
            return False
    return True


def compressed_attention(
    plan: CompressedPlan,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool = True,
) -> torch.Tensor:
    """Attention of ``query`` over everything a TurboQuantLayer holds (sinks, compressed part, window).

    Parameters
    ----------
    plan : the tag of the tensors returned by ``TurboQuantLayer.update`` for this step
    query : shape [B, Hq, Lq, D], the last Lq positions of the sequence
    attention_mask : None (plain causal, no padding), or shape [B or 1, 1, Lq, N_total] bool (True = visible)
        or float additive
    scaling : softmax scale (default ``D ** -0.5``); softcap : Gemma-2 logit soft-capping or None
    is_causal : whether positions are causal when ``attention_mask`` is None

    Returns
    -------
    attn_output : shape [B, Lq, Hq, D] in ``query``'s dtype (as transformers' sdpa_attention_forward)
    """
    layer = plan.layer
    layer.consume_plan(plan)
    if query.dim() != 4 or query.shape[0] != layer.batch_size or query.shape[1] % layer.num_heads or (
        query.shape[3] != layer.head_dim
    ):
        raise ValueError(
            f"`query` must have shape [{layer.batch_size}, a multiple of {layer.num_heads}, Lq, {layer.head_dim}] "
            f"for TurboQuantLayer {layer.layer_idx}, got {list(query.shape)}"
        )
    batch, _, q_len, head_dim = query.shape
    n_sink, n_comp, n_win = plan.num_sink, plan.num_compressed, plan.num_window
    total = n_sink + n_comp + n_win
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    dev = query.device
    mask = check_mask(attention_mask, batch, q_len, total)
    # Without a mask a single causal query sees everything: no bias to build (the decode fast path).
    all_visible = mask is None and (q_len == 1 or not is_causal)

    # Compressed part: the causal structure + a per-key bias, unless the mask says otherwise.
    comp = slice(n_sink, n_sink + n_comp)
    key_bias = as_bias(mask[:, -1, comp]).expand(batch, n_comp).contiguous() if mask is not None else None
    diagonal = n_comp + n_win - q_len if is_causal else None
    regular = mask is None or q_len == 1 or _is_regular(mask, comp, key_bias, diagonal)
    if softcap is None and regular and layer.is_plain:
        first_causal_rows = min(max(q_len - n_win, 0), q_len) if is_causal else 0
        out_c, lse_c = _compressed_fast(layer, query, key_bias, first_causal_rows, scale)
    else:
        if not regular:
            _warn_once("irregular", "flashquant: a mask that is not causal + padding takes the slower exact torch path")
        if softcap is not None and query.is_cuda:
            _warn_once("softcap", "flashquant: soft-capped attention (Gemma-2) dequantizes the compressed part in "
                       "torch every step; the fused kernels do not soft-cap")
        if mask is not None:
            block = as_bias(mask[:, :, comp]).expand(batch, q_len, n_comp)
        else:
            block = torch.zeros((batch, q_len, n_comp), device=dev)
            if diagonal is not None and q_len > 1:
                block = block.masked_fill(~_causal(q_len, n_comp, diagonal, dev), float("-inf"))
        out_c, lse_c = _compressed_torch(layer, query, block, scale, softcap)

    # Exact parts: sinks at positions [0, S), window at [S + Nc, total).
    parts = []
    if n_sink:
        parts.append((*layer.sink_states(), slice(0, n_sink), total - q_len))
    if n_win:
        parts.append((*layer.window.views(), slice(n_sink + n_comp, total), n_win - q_len))
    if not parts:
        finite = torch.isfinite(lse_c).unsqueeze(-1)
        out = torch.where(finite, out_c, 0)
        return _to_model_layout(out, query.dtype)
    keys = torch.cat([p[0] for p in parts], dim=2) if len(parts) > 1 else parts[0][0]
    values = torch.cat([p[1] for p in parts], dim=2) if len(parts) > 1 else parts[0][1]
    if mask is not None:
        exact_bias = as_bias(torch.cat([mask[:, :, p[2]] for p in parts], dim=-1)).expand(batch, q_len, -1)
    elif all_visible:
        exact_bias = None
    else:
        visible = torch.cat([_causal(q_len, p[0].shape[2], p[3], dev) for p in parts], dim=-1)
        exact_bias = _bias_from(visible)[None]
    out_e, lse_e = exact_attention(query, keys, values, exact_bias, scale, softcap)

    stacked_out, stacked_lse = torch.stack([out_c, out_e]), torch.stack([lse_c, lse_e])
    merge = implementation("merge_partials", stacked_out, backend=layer.config.backend)
    out, _ = merge.merge_partials(stacked_out, stacked_lse)
    return _to_model_layout(out, query.dtype)


# --------------------------------------------------------------------------------------------- interface
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
        _warn_once("output_attentions", "flashquant: `output_attentions` is not supported; attention weights are None")


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
        bias = _bias_from(_causal(q_len, kv_len, kv_len - q_len, query.device))[None]
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    out, _ = exact_attention(query, key, value, bias, scale, softcap)
    return _to_model_layout(out, query.dtype), None


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
