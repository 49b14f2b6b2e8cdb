"""Reference TurboQuant compression: norm, rotation, bucketize, pack."""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing import pack_indices


def compress(
    x: Tensor, rotation: Tensor, boundaries: Tensor, bits: int, centroids: Tensor | None = None,
    norm_correction: bool = False, hadamard_signs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Compress head vectors.

    Parameters
    ----------
    x : shape [..., D], fp16/bf16/fp32
    rotation : shape [D, D] fp32, rows rotate as ``x @ rotation.T``
    boundaries : shape [2^bits - 1] fp32, sorted
    centroids : shape [2^bits] fp32; needed only for ``norm_correction``
    norm_correction : store ``||x|| / ||centroids[idx]||`` so the reconstruction keeps the exact norm
    hadamard_signs : shape [D] fp32, given when ``rotation`` is ``H diag(s) / sqrt(D)``; kernels may then use a
        fast Walsh-Hadamard transform. The reference always uses the dense matrix.

    Returns
    -------
    packed : uint8 [..., ceil(D*bits/8)]; norms : fp32 [...]
    """
    xf = x.float()
    norms = torch.linalg.vector_norm(xf, dim=-1)
    unit = xf / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    rotated = unit @ rotation.T
    indices = torch.bucketize(rotated, boundaries, right=True)
    if norm_correction:
        if centroids is None:
            raise ValueError("`centroids` are required when `norm_correction` is True")
        recon_norm = torch.linalg.vector_norm(centroids[indices], dim=-1)
        norms = norms / recon_norm.clamp_min(torch.finfo(torch.float32).tiny)
    return pack_indices(indices, bits), norms
