"""The attention of one decode step over a :class:`~flashquant_hf.static_layer.StaticTurboQuantLayer`, with fixed
shapes and device-side lengths (``torch.compile`` / CUDA-graph friendly).

1. The exact part (sinks and window ring, one buffer) is attended in torch with a bias that hides the slots the
   device counters mark as empty (and padding, from the mask). Its ``(out, lse)`` is moved into the compressed
   part's frame: value-rotated space (``(out - mu_v) @ Pi_V.T``) and the key-centring shift (``lse - scale q.mu_k``).
2. ``flashquant::decode_merged`` attends the compressed store over its live length and merges the exact part in
   as one more split of the same log-sum-exp merge.
3. The merged output is rotated back once (``@ Pi_V``, ``+ mu_v``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import custom_ops  # noqa: F401  (registers torch.ops.flashquant)
from .attention import _grouped, exact_attention, to_model_layout
from .masks import as_bias

if TYPE_CHECKING:
    from .static_layer import StaticTurboQuantLayer


def _exact_bias(layer: StaticTurboQuantLayer, row_bias: torch.Tensor | None, batch: int) -> torch.Tensor:
    """fp32 ``[B, 1, S + R + block]``: 0 for the live sink and window slots (and visible under the mask), else -inf."""
    sinks, ring = layer.config.sink_tokens, layer.window_capacity
    n_sink, n_comp, start, n_win = layer.counts.unbind()
    slots = layer.exact_slots
    order = (slots - sinks - start) % ring  # age rank of a ring slot (0 = oldest)
    live = torch.where(slots < sinks, slots < n_sink, order < n_win)
    bias = torch.zeros(live.shape, dtype=torch.float32, device=live.device).masked_fill(~live, float("-inf"))
    if row_bias is not None:  # the positions the slots hold: sinks first, then the compressed part, then the window
        positions = torch.where(slots < sinks, slots, n_sink + n_comp + order).clamp(max=row_bias.shape[-1] - 1)
        bias = bias + row_bias.index_select(1, positions)
    return bias.expand(batch, -1)[:, None, :]


def static_decode_attention(
    layer: StaticTurboQuantLayer, query: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over everything ``layer`` holds.

    Parameters
    ----------
    query : shape [B, Hq, 1, D]
    attention_mask : None (no padding) or shape [B or 1, 1, 1, max_cache_len] bool (True = visible) or float
        additive, over the positions of the whole capacity (what transformers builds for a static layer)
    scaling : softmax scale (default ``D ** -0.5``); softcap : must be None

    Returns
    -------
    attn_output : shape [B, 1, Hq, D] in ``query``'s dtype
    """
    batch, q_heads, q_len, head_dim = query.shape
    if q_len != 1 or batch != layer.batch_size or head_dim != layer.head_dim or q_heads % layer.num_heads:
        raise ValueError(
            f"a static TurboQuantCache attends one query token per sequence: `query` must have shape "
            f"[{layer.batch_size}, a multiple of {layer.num_heads}, 1, {layer.head_dim}], got {list(query.shape)}"
        )
    if softcap is not None:
        raise NotImplementedError("a static TurboQuantCache does not soft-cap attention scores (Gemma-2); use the "
                                  "dynamic mode (TurboQuantCache() without max_cache_len)")
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    sinks, capacity = layer.config.sink_tokens, layer.store_capacity
    row_bias = key_bias = None
    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < sinks + capacity:
            raise ValueError(
                f"`attention_mask` must have shape [B or 1, 1, 1, >= {sinks + capacity}] over the static cache's "
                f"positions, got {list(attention_mask.shape)}"
            )
        row_bias = as_bias(attention_mask[:, 0, -1])
        key_bias = row_bias[:, sinks : sinks + capacity].expand(batch, capacity).contiguous()

    out_e, lse_e = exact_attention(query, layer.exact_k, layer.exact_v, _exact_bias(layer, row_bias, batch), scale)
    kv_heads = layer.num_heads
    if layer.key_mean is not None:
        q_mu = (_grouped(query.float(), kv_heads) * layer.key_mean[:, :, None, None, :]).sum(-1)
        lse_e = lse_e - scale * q_mu.reshape(lse_e.shape)
    if layer.value_mean is not None:
        out_e = (_grouped(out_e, kv_heads) - layer.value_mean[:, :, None, None, :]).reshape(out_e.shape)
    key_rotation, _, key_centroids, _ = layer.tables["key"]
    value_rotation, _, value_centroids, _ = layer.tables["value"]
    q_rot = (query.float() @ key_rotation.T).to(query.dtype)
    # A side with inline norms passes its rows and None: the op splits them (store_layout).
    (kp, kn), (vp, vn) = ((packed[:, :, :capacity], None if norms is None else norms[:, :, :capacity])
                          for packed, norms in layer.store_sides())
    out_rot, _ = torch.ops.flashquant.decode_merged(
        q_rot, kp, kn, vp, vn, key_centroids, value_centroids, layer.lengths, key_bias,
        (out_e @ value_rotation.T).contiguous(), lse_e.contiguous(), layer.key_codec.quantizer.bits,
        layer.value_codec.quantizer.bits, scale, layer.backend,
    )
    out = out_rot @ value_rotation
    if layer.value_mean is not None:
        out = (_grouped(out, kv_heads) + layer.value_mean[:, :, None, None, :]).reshape(out.shape)
    return to_model_layout(out, query.dtype)
