"""Reference decode attention over the paged TurboQuant store: gather each sequence's blocks into the
contiguous layout and run the reference ``tq_attention`` (so paged == contiguous by construction)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..paged import PagedLayout
from .tq_attention import tq_attention


def paged_decode(
    q_rot: Tensor, blocks: Tensor, block_table: Tensor, seq_lens: Tensor, k_centroids: Tensor, v_centroids: Tensor,
    k_bits: int, v_bits: int, scale: float, block_size: int, max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """One query token per sequence over its paged, compressed keys and values (rotated space).

    Parameters
    ----------
    q_rot : shape [S, Hq, D], queries already rotated by the key rotation
    blocks : uint8 shape [num_blocks, H_kv, block_size * (kb + vb + 8)], one layer (see flashquant_hf.paged)
    block_table : int32 shape [S, max_blocks]; seq_lens : int32 shape [S]
    k_centroids, v_centroids : fp32 shape [2^bits]
    scale : softmax scale; block_size : tokens per block
    max_seq_len : optional host-side ``max(seq_lens)`` (kernels plan with it; unused here)

    Returns
    -------
    out_rot : fp32 shape [S, Hq, D] (value-rotated space); lse : fp32 shape [S, Hq] (-inf for an empty sequence)
    """
    num_seqs, q_heads, head_dim = q_rot.shape
    layout = PagedLayout(block_size, blocks.shape[1], head_dim, k_bits, v_bits)
    k_idx, k_nrm, v_idx, v_nrm = layout.sections(blocks)
    out = torch.empty(num_seqs, q_heads, head_dim, dtype=torch.float32, device=q_rot.device)
    lse = torch.empty(num_seqs, q_heads, dtype=torch.float32, device=q_rot.device)
    lens = seq_lens.tolist()
    for s, length in enumerate(lens):
        ids = block_table[s, : -(-length // block_size)].long()

        def gather(section: torch.Tensor) -> torch.Tensor:
            # [nb, H, bs, ...] -> [1, H, nb * bs, ...] -> first `length` tokens
            x = section[ids].transpose(0, 1).flatten(1, 2)[:, :length]
            return x.unsqueeze(0)

        o, l = tq_attention(
            q_rot[s : s + 1, :, None, :], gather(k_idx), gather(k_nrm), gather(v_idx), gather(v_nrm),
            k_centroids, v_centroids, k_bits, v_bits, scale,
        )
        out[s], lse[s] = o[0, :, 0], l[0, :, 0]
    return out, lse
