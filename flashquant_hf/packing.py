"""Bit packing of quantization indices: one MSB-first bit stream per vector (see docs/ARCHITECTURE.md).

Coordinate 0 lands in the most significant bits of byte 0; for TQ4, byte j = idx[2j] << 4 | idx[2j+1].
Every kernel reads and writes exactly this order.
"""

from __future__ import annotations

import torch

from .codebook import SUPPORTED_BITS


def packed_size(head_dim: int, bits: int) -> int:
    """Bytes that one vector of ``head_dim`` indices of ``bits`` bits occupies."""
    return (head_dim * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {bits!r}")


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``indices [..., D]`` (integers in [0, 2^bits)) into ``uint8 [..., ceil(D*bits/8)]``."""
    _check_bits(bits)
    idx = indices.to(torch.uint8)
    if bits == 4 and idx.shape[-1] % 2 == 0:
        return (idx[..., 0::2] << 4) | idx[..., 1::2]
    head_dim = idx.shape[-1]
    shifts = torch.arange(bits - 1, -1, -1, device=idx.device, dtype=torch.uint8)
    stream = ((idx.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., D*bits], MSB first
    pad = packed_size(head_dim, bits) * 8 - stream.shape[-1]
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], device=idx.device, dtype=torch.uint8)
    return (stream.unflatten(-1, (-1, 8)) * weights).sum(-1, dtype=torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: ``uint8 [..., nbytes]`` -> ``int64 [..., head_dim]``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"`packed` must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_size(head_dim, bits):
        raise ValueError(
            f"`packed` must have last dimension {packed_size(head_dim, bits)} for head_dim={head_dim}, "
            f"bits={bits}; got {packed.shape[-1]}"
        )
    if bits == 4 and head_dim % 2 == 0:
        return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2).long()
    if head_dim % 8 == 0:  # 8 indices fill exactly `bits` bytes: one integer word per group, then shifts
        groups = packed.unflatten(-1, (head_dim // 8, bits)).to(torch.int32)
        byte_shifts = 8 * torch.arange(bits - 1, -1, -1, device=packed.device, dtype=torch.int32)
        words = (groups << byte_shifts).sum(-1, dtype=torch.int32)
        index_shifts = bits * torch.arange(7, -1, -1, device=packed.device, dtype=torch.int32)
        return ((words.unsqueeze(-1) >> index_shifts) & ((1 << bits) - 1)).flatten(-2).long()
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : head_dim * bits]
    weights = 1 << torch.arange(bits - 1, -1, -1, device=packed.device)
    return (stream.unflatten(-1, (head_dim, bits)).long() * weights).sum(-1)
