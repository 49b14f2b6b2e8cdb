"""``centroid_values`` and ``dequantize_rotated`` for CPU tensors: one table lookup per packed group instead of
unpacking every index.

A code of 1, 2 or 4 bits puts ``8 / bits`` whole indices in each byte, a 3-bit code four indices in each 12-bit
half of its 3-byte groups: a table of ``2^group_bits`` rows of ``group_bits / bits`` centroids (256 x 2 for TQ4,
4096 x 4 for TQ3, at most 64 KiB) turns each group into its centroids with one ``index_select``. The centroids
are the same fp32 numbers as ``centroids[idx]``, multiplied by the same norms: bit for bit the reference.
"""

from __future__ import annotations

import functools

import torch

from ..packing import packed_size


ROW_AS_ELEMENT = {2: torch.float64, 4: torch.complex128}  # table rows of 8 and 16 bytes


def _group_bits(bits: int) -> int:
    return 12 if bits == 3 else 8


def unsupported(head_dim: int, bits: int) -> str | None:
    """Why the table lookup cannot decode ``head_dim`` indices of ``bits`` bits (a phrase), or None."""
    per_unit = 8 if bits == 3 else 8 // bits  # indices per whole byte, or per 3 bytes of a 3-bit code
    if head_dim % per_unit:
        return f"head_dim {head_dim} with {bits}-bit codes (whole groups of {per_unit} indices)"
    return None


@functools.lru_cache(maxsize=64)
def _table(centroid_values: tuple[float, ...], bits: int) -> torch.Tensor:
    """fp32 ``[2^group_bits, group_bits / bits]``: row ``g`` holds the centroids of the indices packed in ``g``."""
    group = _group_bits(bits)
    shifts = bits * torch.arange(group // bits - 1, -1, -1)
    indices = (torch.arange(1 << group)[:, None] >> shifts) & ((1 << bits) - 1)
    table = torch.tensor(centroid_values, dtype=torch.float32)[indices]
    # index_select copies one element per group far faster than one short row: view each row as one wide element.
    wide = ROW_AS_ELEMENT.get(table.shape[1])
    return table.view(wide).squeeze(-1) if wide is not None else table


def _groups(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 group values ``[..., nbytes * 8 / group_bits]`` of ``packed [..., nbytes]``."""
    if bits != 3:
        return packed.to(torch.int32)
    triples = packed.unflatten(-1, (-1, 3)).to(torch.int32)
    b0, b1, b2 = triples.unbind(-1)
    return torch.stack([(b0 << 4) | (b1 >> 4), ((b1 & 15) << 8) | b2], dim=-1).flatten(-2)


def centroid_values(packed: torch.Tensor, centroids: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """``centroids[idx]``, fp32 ``[..., head_dim]`` (see the reference of the same name).

    packed : uint8 shape [..., ceil(head_dim * bits / 8)]; centroids : fp32 shape [2^bits]

    >>> centroid_values(torch.tensor([[0x1F]], dtype=torch.uint8), torch.arange(16.0), 4, 2)
    tensor([[ 1., 15.]])
    """
    if packed.dtype != torch.uint8 or packed.shape[-1] != packed_size(head_dim, bits):
        raise ValueError(
            f"`packed` must be uint8 of shape [..., {packed_size(head_dim, bits)}] for head_dim={head_dim}, "
            f"bits={bits}; got {str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}"
        )
    table = _table(tuple(centroids.tolist()), bits)
    groups = _groups(packed, bits).reshape(-1)
    return table.index_select(0, groups).view(torch.float32).view(*packed.shape[:-1], head_dim)


def dequantize_rotated(
    packed: torch.Tensor, norms: torch.Tensor, centroids: torch.Tensor, bits: int, head_dim: int
) -> torch.Tensor:
    """``norm * centroids[idx]`` in rotated space, fp32 ``[..., head_dim]`` (see the reference of the same name).

    packed : uint8 shape [..., ceil(head_dim * bits / 8)]; norms : fp32 shape [...]; centroids : fp32 [2^bits]
    """
    return centroid_values(packed, centroids, bits, head_dim) * norms.unsqueeze(-1)
