"""Where the contiguous store keeps a plain code's fp32 norms: in a tensor of their own, or after each code row.

Per side (keys, values) of a layer, ``[B, H_kv, N, ...]`` along the token axis N:

* separate: ``packed [B, H_kv, N, bytes]`` uint8 and ``norms [B, H_kv, N]`` fp32;
* inline: one uint8 buffer ``rows [B, H_kv, N, bytes + 4]``, each row ``codes | norm``; ``packed`` and ``norms`` are
  views of it (:func:`split_rows`), and every consumer reads them through their strides.

On sm_90 the decode stages 16-key tiles into shared memory with one bulk copy per run of 16 rows
(``cuda/tq_decode.cu``). Inline norms make one run per side instead of two, and a tile of two runs reaches shared
memory sooner than one of four (docs/kernels_decode.md). A side is inline where the decode stages the tiles of its
widths and its rows keep the alignment of the lanes' loads with the 4 norm bytes added (:func:`inline_norms`); 4-bit
keys at head_dim 128, for one, keep separate norms: a 68-byte row would break their 16-byte loads.
"""

from __future__ import annotations

import torch

from .packing import packed_size

NORM_BYTES = 4  # one fp32 norm per row
STAGED_HEAD_DIMS = (64, 128)  # the 8-warp decode builds, the ones that stage tiles


def slice_bytes(head_dim: int, bits: int, keys: bool) -> int:
    """Bytes of a decode lane's slice of one packed row: a quarter of a key row or an eighth of a value row."""
    return head_dim * bits // (32 if keys else 64)


def slice_alignment(head_dim: int, bits: int, keys: bool) -> int:
    """Byte alignment a row of packed codes needs: a lane reads its slice (:func:`slice_bytes`) in pieces of up to 16
    bytes (the widest power of two dividing it)."""
    lane_bytes = slice_bytes(head_dim, bits, keys)
    return min(16, lane_bytes & -lane_bytes)


def slice_loads(head_dim: int, bits: int, keys: bool) -> int:
    """Register loads a lane spends on its slice of one packed row: :func:`slice_bytes` in pieces of
    :func:`slice_alignment` bytes."""
    return slice_bytes(head_dim, bits, keys) // slice_alignment(head_dim, bits, keys)


def contiguous_staging_pays(head_dim: int, k_bits: int, v_bits: int) -> bool:
    """Whether the contiguous layout stages its tiles at these widths: where a lane's key or value slice takes several
    register loads (3-bit codes at head_dim 128: three for a key quarter or a value eighth). Where each takes one
    (4- and 2-bit codes) the register loads beat the tile's copies (docs/kernels_decode.md, "Measured and
    rejected")."""
    return max(slice_loads(head_dim, k_bits, keys=True), slice_loads(head_dim, v_bits, keys=False)) > 1


def _keeps_alignment(head_dim: int, bits: int, keys: bool) -> bool:
    pitch = packed_size(head_dim, bits) + NORM_BYTES
    return pitch & -pitch >= slice_alignment(head_dim, bits, keys)


def inline_norms(head_dim: int, k_bits: int, v_bits: int) -> tuple[bool, bool]:
    """(keys, values): whether each side of a plain code stores its norms after its code rows (see the module)."""
    if head_dim not in STAGED_HEAD_DIMS or not contiguous_staging_pays(head_dim, k_bits, v_bits):
        return False, False
    return _keeps_alignment(head_dim, k_bits, keys=True), _keeps_alignment(head_dim, v_bits, keys=False)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [..., bytes], norms [...] fp32)``: views of inline rows ``[..., bytes + 4]`` uint8."""
    row_bytes = rows.shape[-1] - NORM_BYTES
    return rows[..., :row_bytes], rows[..., row_bytes:].view(torch.float32).squeeze(-1)


def norms_follow_rows(packed: torch.Tensor, norms: torch.Tensor) -> bool:
    """Whether ``norms`` starts right after the first code row of ``packed`` (views of inline rows; their strides say
    the rest)."""
    return norms.data_ptr() == packed.data_ptr() + packed.shape[-1]


def joined_rows(packed: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Inline rows ``[..., bytes + 4]`` uint8 of ``packed [..., bytes]`` and contiguous fp32 ``norms [...]``."""
    return torch.cat((packed, norms.unsqueeze(-1).view(torch.uint8)), dim=-1)
