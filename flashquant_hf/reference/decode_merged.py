"""Reference ``decode_merged``: one query token per sequence over a fixed-capacity compressed store whose live length
is a device tensor, merged with one more partial result (the exact sinks and window) in the same log-sum-exp merge."""

from __future__ import annotations

import torch
from torch import Tensor

from .merge_partials import merge_partials
from .tq_attention import tq_attention


def decode_merged(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, lengths: Tensor, key_bias: Tensor | None, extra_out: Tensor, extra_lse: Tensor, k_bits: int,
    v_bits: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q_rot`` over the first ``lengths[b]`` keys of each sequence, merged with ``(extra_out,
    extra_lse)``.

    Parameters
    ----------
    q_rot : shape [B, Hq, 1, D], already ``q @ Pi_K.T``
    k_packed, v_packed, k_norms, v_norms : the store at full capacity, ``[B, H_kv, N, ...]``
    lengths : int32 shape [B], live keys of each sequence (keys from ``lengths[b]`` on are not attended)
    key_bias : optional fp32 shape [B, N] added to every score of key j (0 or -inf for padding)
    extra_out : fp32 shape [B, Hq, 1, D] in the same (value-rotated) space; extra_lse : fp32 shape [B, Hq, 1]

    Returns
    -------
    out_rot : fp32 shape [B, Hq, 1, D]; lse : fp32 shape [B, Hq, 1] (-inf, out 0 where nothing is visible)
    """
    capacity = k_packed.shape[2]
    live = torch.arange(capacity, device=q_rot.device)[None, :] < lengths.to(q_rot.device)[:, None]
    bias = torch.zeros(live.shape, dtype=torch.float32, device=q_rot.device).masked_fill_(~live, float("-inf"))
    if key_bias is not None:
        bias = bias + key_bias
    out, lse = tq_attention(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits,
                            scale, key_bias=bias)
    return merge_partials(torch.stack([out, extra_out.float()]), torch.stack([lse, extra_lse.float()]))
