"""Seeded random orthogonal rotations, stored as dense ``[D, D]`` fp32 matrices.

Both kinds are generated in float64 with NumPy's PCG64 stream, which is identical on every machine and
NumPy version, so a seed names one matrix everywhere.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

ROTATIONS = ("haar", "hadamard")


def _check_args(head_dim: int, kind: str) -> None:
    if kind not in ROTATIONS:
        raise ValueError(f"`rotation` must be one of {ROTATIONS}, got {kind!r}")
    if not isinstance(head_dim, int) or head_dim < 2:
        raise ValueError(f"`head_dim` must be an integer >= 2, got {head_dim!r}")
    if kind == "hadamard" and head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two `head_dim`, got {head_dim}")


def _haar(head_dim: int, seed: int) -> np.ndarray:
    gaussian = np.random.default_rng(seed).standard_normal((head_dim, head_dim))
    q, r = np.linalg.qr(gaussian)
    # The sign fix makes Q Haar-distributed (plain QR is biased by LAPACK's sign convention).
    return q * np.sign(np.diag(r))


def _hadamard(head_dim: int, seed: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=head_dim)
    # H diag(s) / sqrt(D): orthogonal, applied in D log D by a fast transform if a kernel wants to.
    return h * signs[None, :] / np.sqrt(head_dim)


@functools.lru_cache(maxsize=None)
def _rotation_f64(head_dim: int, seed: int, kind: str) -> np.ndarray:
    _check_args(head_dim, kind)
    matrix = _haar(head_dim, seed) if kind == "haar" else _hadamard(head_dim, seed)
    matrix.setflags(write=False)
    return matrix


def random_rotation(
    head_dim: int, seed: int = 0, kind: str = "haar", device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Orthogonal matrix ``Pi`` of shape ``[head_dim, head_dim]`` (fp32); rotate rows with ``x @ Pi.T``.

    >>> pi = random_rotation(64, seed=1)
    >>> torch.allclose(pi @ pi.T, torch.eye(64), atol=1e-5)
    True
    """
    return torch.tensor(_rotation_f64(head_dim, seed, kind), dtype=torch.float32, device=device)


def hadamard_signs(head_dim: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The random signs ``s`` of the Hadamard rotation ``Pi = H diag(s) / sqrt(D)`` (fp32 ``[D]``).

    Kernels given these signs may apply ``Pi`` as a fast Walsh-Hadamard transform instead of a dense matmul:
    ``y = x @ Pi.T = FWHT(s * x) / sqrt(D)`` and ``x = y @ Pi = s * FWHT(y) / sqrt(D)``.
    """
    matrix = _rotation_f64(head_dim, seed, "hadamard")
    return torch.tensor(matrix[0] * np.sqrt(head_dim), dtype=torch.float32, device=device)
