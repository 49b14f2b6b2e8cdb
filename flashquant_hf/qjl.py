"""QJL: a 1-bit Johnson-Lindenstrauss sketch of a residual, for unbiased inner products (TurboQuant_prod).

TurboQuant_prod stores keys as a (b-1)-bit MSE code plus ``sign(S r)`` of the residual ``r = k - k_mse`` and
``||r||``. With ``S`` of shape ``[m, D]`` and i.i.d. N(0, 1) entries (NOT divided by sqrt(m)),

    <q, r>  ~=  sqrt(pi/2) / m * ||r|| * <S q, sign(S r)>

is unbiased, because E[<s, q> sign(<s, r>)] = sqrt(2/pi) <q, r> / ||r|| for s ~ N(0, I).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .packing import pack_indices, unpack_indices

SKETCH_STREAM = 0x514A4C  # "QJL"


class QJLSketch:
    """Sign sketch of ``m`` Gaussian projections of ``head_dim``-vectors.

    >>> sk = QJLSketch(64, seed=0)
    >>> r, q = torch.randn(10, 64), torch.randn(10, 64)
    >>> signs, norms = sk.encode(r)
    >>> sk.inner_product(q, signs, norms).shape
    torch.Size([10])
    """

    def __init__(self, head_dim: int, m: int | None = None, seed: int = 0):
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"`head_dim` must be a positive integer, got {head_dim!r}")
        self.head_dim = head_dim
        self.m = m or head_dim
        if self.m % 8:
            raise ValueError(f"`m` must be a multiple of 8 so the signs pack into whole bytes, got {self.m}")
        self.seed = seed

    @functools.cache
    def projection(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """S, fp32 ``[m, head_dim]`` with i.i.d. standard normal entries (seeded, machine-independent)."""
        # A stream of its own: rotations draw their Gaussian matrix from default_rng(seed), and a sketch equal to
        # the rotation's matrix correlates S with the quantization residual (measured: scores biased by ~1%).
        s = np.random.default_rng([self.seed, SKETCH_STREAM]).standard_normal((self.m, self.head_dim))
        return torch.tensor(s, dtype=torch.float32, device=device)

    def encode(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed signs uint8 ``[..., m/8]``, fp32 ``||r||`` ``[...]``) of residuals ``r [..., head_dim]``."""
        if r.shape[-1] != self.head_dim:
            raise ValueError(f"`r` must have shape [..., {self.head_dim}], got {list(r.shape)}")
        projected = r.float() @ self.projection(r.device).T
        return pack_indices((projected >= 0).to(torch.uint8), 1), torch.linalg.vector_norm(r.float(), dim=-1)

    def inner_product(self, q: torch.Tensor, signs: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """Unbiased estimate of ``<q, r>`` for each pair (broadcast over leading dims)."""
        sign_values = unpack_indices(signs, 1, self.m).float() * 2 - 1
        sq = q.float() @ self.projection(q.device).T
        return math.sqrt(math.pi / 2) / self.m * norms * (sq * sign_values).sum(-1)
