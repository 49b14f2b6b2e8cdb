"""The attention over a TurboQuantLayer: its compressed part through ``ops.tq_attention``, its exact parts in
torch, merged by log-sum-exp.

The compressed-path algorithm (one call, ``Lq`` queries, the layer holding ``S`` sinks, ``Nc`` compressed and
``W`` window tokens; queries are the last ``Lq`` positions):

1. ``q_rot = q @ Pi_K.T`` once; ``ops.tq_attention`` over the compressed part. With causal masking the first
   ``Lq - W`` queries (if any) see the compressed part bottom-right-causally, the others see all of it; padding
   comes from the 4D mask as a per-key bias. Key centring shifts every compressed score of one query by
   ``scale * q . mu_k``: added to that part's log-sum-exp.
2. ``out_c @ Pi_V`` once (+ ``mu_v`` with value centring).
3. The exact parts (sinks and window) attended in torch with their own log-sum-exp (one FlashAttention-2 call of
   torch when every query sees them on a GPU: :func:`exact_attention_visible`), then ``ops.merge_partials``.

A mask that is not "causal structure + per-key bias" (a custom 4D mask, a sliding window over a compressed
layer during a multi-token chunk), soft-capping (Gemma-2) and split codes (outlier channels, QJL residual;
:mod:`flashquant_hf.codec`) take an exact torch path instead (correct, slower: the codecs rebuild the compressed
K/V in their rotated spaces). Every op runs on the layer's backend, decided once when the layer was initialised.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from . import ops
from .backend import device_capability
from .log import warn_once
from .masks import as_bias, bias_from, causal_visible, check_mask, is_regular
from .tags import CompressedPlan

if TYPE_CHECKING:
    from .layer import TurboQuantLayer

logger = logging.getLogger(__name__)

TORCH_ROWS = 64  # query rows per block of the torch path (its scores are [B, Hq, rows, Nc] fp32)
# Up to this many query rows the CPU path runs on one thread: its ~20 ops per layer are small, and on a CPU shared
# with other jobs every op that torch spreads over threads waits at its barrier for a descheduled thread
# (SmolLM2, 2 threads, a loaded 2-core machine: a decode step 4x slower than on one thread).
SERIAL_ROWS = 8


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


FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def _flash_serves(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether torch's FlashAttention-2 kernel takes the exact part: fp16/bf16 K/V on an sm_80+ GPU, head_dim a
    multiple of 8 up to 256."""
    head_dim = query.shape[-1]
    return (query.is_cuda and query.dtype in FLASH_DTYPES and keys.dtype == query.dtype and keys.shape[2] > 0
            and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM
            and device_capability(query.get_device())[0] >= 8)


def exact_attention_visible(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact_attention` where every query row sees every key (a decode step without mask or soft-capping).

    On a GPU with fp16/bf16 K/V this is one FlashAttention-2 kernel of torch (fp32 scores, the value product on
    half-precision probabilities, as SDPA computes it) instead of a dozen ops, each a kernel launch that the host pays
    for on every layer of every step; the GQA group is folded into the query rows, which needs no repeated K/V.
    Returns out ``[B, Hq, Lq, D]`` (in the K/V dtype on that path, fp32 otherwise) and fp32 lse ``[B, Hq, Lq]``.
    """
    if not _flash_serves(query, keys):
        return exact_attention(query, keys, values, None, scale)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = keys.shape[1]
    rows = query.reshape(batch, kv_heads, q_heads // kv_heads * q_len, head_dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(rows, keys, values, scale=scale)[:2]
    return out.view(batch, q_heads, q_len, head_dim), lse.view(batch, q_heads, q_len)


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


def to_model_layout(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
    q32 = query.float()
    q_rot = (q32 @ tq_k.rotation(dev).T).to(query.dtype)
    args = (kp, kn, vp, vn, tq_k.centroids(dev), tq_v.centroids(dev), tq_k.bits, tq_v.bits, scale)
    outs, lses = [], []
    q_len = query.shape[2]
    for rows, causal in ((slice(0, first_causal_rows), True), (slice(first_causal_rows, q_len), False)):
        if rows.stop > rows.start:
            q_rows = q_rot[:, :, rows].contiguous()
            out, lse = ops.tq_attention(q_rows, *args, causal=causal, key_bias=key_bias, backend=layer.backend)
            outs.append(out)
            lses.append(lse)
    out_rot = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    out = out_rot.float() @ tq_v.rotation(dev)
    return _uncenter(layer, q32, out, lse.float(), scale)


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


def _merged_torch(
    layer: TurboQuantLayer,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """The whole layer in one softmax (the torch path on a CPU): [B, Hq, Lq, D] fp32 in model space.

    ``mask``: the checked ``[B or 1, Lq, total]`` mask or None. The scores of the sinks, the compressed part (the
    codecs multiply in their rotated spaces) and the window sit side by side in one row, so no part needs its own
    log-sum-exp and no merge follows; any mask and soft-capping apply to the whole row. Up to SERIAL_ROWS query rows
    (decode) run on one thread; long chunks run in blocks of TORCH_ROWS query rows.
    """
    q_len, total = query.shape[2], layer.get_seq_length()
    if q_len <= SERIAL_ROWS and torch.get_num_threads() > 1:
        with one_thread():
            return _merged_torch(layer, query, mask, scale, softcap, is_causal)
    outs = []
    for r0 in range(0, q_len, TORCH_ROWS):
        rows = slice(r0, min(r0 + TORCH_ROWS, q_len))
        if mask is not None:
            bias = as_bias(mask[:, rows])
        elif is_causal and q_len > 1:
            bias = bias_from(causal_visible(rows.stop - r0, total, total - q_len + r0, query.device))[None]
        else:
            bias = None
        outs.append(_merged_rows(layer, query[:, :, rows], bias, scale, softcap))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to 1 inside the block and the caller's count put back after it, also when the
    block raises: small ops gain nothing from a second thread, and on an oversubscribed CPU every parallel region of
    a 2-thread pool waits for a descheduled thread (measured on a shared 2-core runner: 10-20 ms per small op; a
    SmolLM2 decode step at 1K context 0.2 s instead of 1.5-3.3 s). torch.set_num_threads is the one switch that also
    reaches the MKL matmuls: an OpenMP limit of the calling thread alone left the step as slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _merged_rows(
    layer: TurboQuantLayer, query: torch.Tensor, bias: torch.Tensor | None, scale: float, softcap: float | None
) -> torch.Tensor:
    """:func:`_merged_torch` for one block of query rows (``bias`` fp32 ``[B or 1, Lq, total]`` or None)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = layer.num_heads
    q = query.float().reshape(batch, kv_heads, -1, head_dim)
    sinks = layer.sink_states()
    window = layer.window.views() if layer.num_window else None
    compressed = layer.key_codec.dot(q, layer.key_views(), layer.key_order)
    if layer.key_mean is not None:
        compressed = compressed + q @ layer.key_mean.unsqueeze(-1)
    parts = [compressed]  # in the positions' order: sinks, compressed part, window
    if sinks is not None:
        parts.insert(0, q @ sinks[0].float().transpose(-1, -2))
    if window is not None:
        parts.append(q @ window[0].float().transpose(-1, -2))
    scores = (torch.cat(parts, dim=-1) if len(parts) > 1 else compressed) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = (scores.view(batch, kv_heads, -1, q_len, scores.shape[-1]) + bias[:, None, None]).view(scores.shape)
    probs = torch.softmax(scores, dim=-1)
    if bias is not None:
        probs = probs.nan_to_num_(0.0)  # a row that sees nothing: softmax over -inf only is NaN; it gets 0
    n_sink, n_comp = layer.num_sink, layer.num_compressed
    p_comp = probs[..., n_sink : n_sink + n_comp]
    out = layer.value_codec.weighted_sum(p_comp, layer.value_views(), layer.value_order)
    if layer.value_mean is not None:
        out = out + p_comp.sum(-1, keepdim=True) * layer.value_mean.unsqueeze(2)
    if sinks is not None:
        out = out + probs[..., :n_sink] @ sinks[1].float()
    if window is not None:
        out = out + probs[..., n_sink + n_comp :] @ window[1].float()
    return out.view(batch, q_heads, q_len, head_dim)


def _uncenter(
    layer: TurboQuantLayer, q32: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo key/value centring on a compressed part's (out, lse) (``q32``: the fp32 query ``[B, Hq, Lq, D]``): every
    compressed score of a query row is short by ``scale * q . mu_k`` (one batched product for all rows), every output
    by ``mu_v``."""
    kv_heads = layer.num_heads
    if layer.key_mean is not None:
        batch, _, _, head_dim = q32.shape
        q_mu = q32.reshape(batch, kv_heads, -1, head_dim) @ layer.key_mean.unsqueeze(-1)
        lse = lse.add(q_mu.view(lse.shape), alpha=scale)
    if layer.value_mean is not None:
        out = (_grouped(out, kv_heads) + layer.value_mean[:, :, None, None, :]).reshape(out.shape)
    return out, lse


def compressed_attention(
    plan: CompressedPlan, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
    softcap: float | None = None, is_causal: bool = True,
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
    if ops.attends_in_one_softmax(layer.backend, query):
        return to_model_layout(_merged_torch(layer, query, mask, scale, softcap, is_causal), query.dtype)
    # Without a mask a single causal query sees everything: no bias to build (the decode fast path).
    all_visible = mask is None and (q_len == 1 or not is_causal)

    # Compressed part: the causal structure + a per-key bias, unless the mask says otherwise.
    comp = slice(n_sink, n_sink + n_comp)
    key_bias = as_bias(mask[:, -1, comp]).expand(batch, n_comp).contiguous() if mask is not None else None
    diagonal = n_comp + n_win - q_len if is_causal else None
    regular = mask is None or q_len == 1 or is_regular(mask, comp, key_bias, diagonal)
    if softcap is None and regular and layer.is_plain:
        first_causal_rows = min(max(q_len - n_win, 0), q_len) if is_causal else 0
        out_c, lse_c = _compressed_fast(layer, query, key_bias, first_causal_rows, scale)
    else:
        if not regular:
            warn_once(logger, "flashquant: a mask that is not causal + padding takes the slower exact torch path")
        if softcap is not None and query.is_cuda:
            warn_once(logger, "flashquant: soft-capped attention (Gemma-2) dequantizes the compressed part in "
                      "torch every step; the fused kernels do not soft-cap")
        if mask is not None:
            block = as_bias(mask[:, :, comp]).expand(batch, q_len, n_comp)
        else:
            block = torch.zeros((batch, q_len, n_comp), device=dev)
            if diagonal is not None and q_len > 1:
                block = block.masked_fill(~causal_visible(q_len, n_comp, diagonal, dev), float("-inf"))
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
        return to_model_layout(out, query.dtype)
    keys = torch.cat([p[0] for p in parts], dim=2) if len(parts) > 1 else parts[0][0]
    values = torch.cat([p[1] for p in parts], dim=2) if len(parts) > 1 else parts[0][1]
    if mask is not None:
        exact_bias = as_bias(torch.cat([mask[:, :, p[2]] for p in parts], dim=-1)).expand(batch, q_len, -1)
    elif all_visible:
        exact_bias = None
    else:
        visible = torch.cat([causal_visible(q_len, p[0].shape[2], p[3], dev) for p in parts], dim=-1)
        exact_bias = bias_from(visible)[None]
    if exact_bias is None and softcap is None:
        out_e, lse_e = exact_attention_visible(query, keys, values, scale)
    else:
        out_e, lse_e = exact_attention(query, keys, values, exact_bias, scale, softcap)

    stacked_out, stacked_lse = torch.stack([out_c, out_e]), torch.stack([lse_c, lse_e])
    out, _ = ops.merge_partials(stacked_out, stacked_lse, backend=layer.backend)
    return to_model_layout(out, query.dtype)
