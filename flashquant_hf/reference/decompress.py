"""Reference TurboQuant decompression: unpack, centroid lookup, scale, rotate back."""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing import unpack_indices


def decompress(
    packed: Tensor, norms: Tensor, rotation: Tensor, centroids: Tensor, bits: int, head_dim: int,
    dtype: torch.dtype = torch.float32, hadamard_signs: Tensor | None = None,
) -> Tensor:
    """Reconstruct ``x_hat = norm * centroids[idx] @ rotation``.

    ``hadamard_signs``: see :func:`flashquant_hf.reference.compress.compress` (ignored here).

    packed : uint8 [..., ceil(D*bits/8)]; norms : fp32 [...]; returns ``dtype`` [..., D].
    """
    indices = unpack_indices(packed, bits, head_dim)
    rotated = centroids[indices] * norms.unsqueeze(-1)
    return (rotated @ rotation).to(dtype)


def centroid_values(packed: torch.Tensor, centroids: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """``centroids[idx]`` (fp32 [..., D]): the unit-norm code in rotated space, before its norm scales it."""
    return centroids[unpack_indices(packed, bits, head_dim)]


def dequantize_rotated(
    packed: torch.Tensor, norms: torch.Tensor, centroids: torch.Tensor, bits: int, head_dim: int
) -> torch.Tensor:
    """``norm * centroids[idx]`` in rotated space (fp32 [..., D]): what the attention kernels read."""
    return centroid_values(packed, centroids, bits, head_dim) * norms.unsqueeze(-1)
