"""TurboQuantizer: the user-facing compressor of head vectors (TurboQuant_mse, arXiv 2504.19874)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import ops
from .codebook import SUPPORTED_BITS, lloyd_max_codebook
from .packing import packed_size
from .rotation import ROTATIONS, hadamard_signs, random_rotation

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class CompressedTensor:
    """Compressed head vectors: packed indices ``uint8 [..., ceil(D*bits/8)]`` and fp32 ``norms [...]``."""

    indices: torch.Tensor
    norms: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int

    @property
    def nbytes(self) -> int:
        """Bytes held: packed indices plus fp32 norms."""
        return self.indices.numel() * self.indices.element_size() + self.norms.numel() * self.norms.element_size()


class TurboQuantizer:
    """Compress vectors ``[..., head_dim]`` to ``bits`` bits per coordinate plus one fp32 norm.

    >>> tq = TurboQuantizer(head_dim=64, bits=4)
    >>> x = torch.randn(3, 5, 64)
    >>> c = tq.compress(x)
    >>> c.nbytes == 15 * (32 + 4)
    True
    >>> tq.decompress(c).shape
    torch.Size([3, 5, 64])
    """

    def __init__(
        self,
        head_dim: int,
        bits: int = 4,
        seed: int = 0,
        rotation: str = "haar",
        norm_correction: bool = False,
    ):
        if not isinstance(head_dim, int) or head_dim < 4 or head_dim % 2:
            raise ValueError(f"`head_dim` must be an even integer >= 4, got {head_dim!r}")
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {bits!r}")
        if rotation not in ROTATIONS:
            raise ValueError(f"`rotation` must be one of {ROTATIONS}, got {rotation!r}")
        self.head_dim = head_dim
        self.bits = bits
        self.seed = seed
        self.rotation_kind = rotation
        self.norm_correction = norm_correction
        self.codebook = lloyd_max_codebook(head_dim, bits)

    def __repr__(self) -> str:
        return (
            f"TurboQuantizer(head_dim={self.head_dim}, bits={self.bits}, seed={self.seed}, "
            f"rotation={self.rotation_kind!r}, norm_correction={self.norm_correction})"
        )

    @property
    def packed_size(self) -> int:
        """Bytes of packed indices per vector."""
        return packed_size(self.head_dim, self.bits)

    @functools.cache
    def rotation(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rotation ``Pi`` fp32 ``[D, D]`` on ``device`` (cached per device)."""
        return random_rotation(self.head_dim, self.seed, self.rotation_kind, device=device)

    @functools.cache
    def hadamard_signs(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Signs of the Hadamard rotation (fp32 ``[D]``) so kernels can use a fast transform; None for Haar."""
        if self.rotation_kind != "hadamard":
            return None
        return hadamard_signs(self.head_dim, self.seed, device=device)

    @functools.cache
    def centroids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Codebook centroids fp32 ``[2^bits]`` on ``device``."""
        return self.codebook.tensors(device)[0]

    @functools.cache
    def boundaries(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Decision boundaries fp32 ``[2^bits - 1]`` on ``device``."""
        return self.codebook.tensors(device)[1]

    def check_input(self, x: torch.Tensor, name: str = "x", check_finite: bool = True) -> None:
        """Raise ValueError unless ``x`` is a finite float tensor ``[..., head_dim]``."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"`{name}` must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"`{name}` must have shape [..., {self.head_dim}] (head_dim), got {list(x.shape)}"
            )
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError(f"`{name}` contains NaN or Inf values")

    def compress_tensors(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, norms) of ``x`` without validation: the hot path for callers that checked already."""
        dev = x.device
        return ops.compress(
            x, self.rotation(dev), self.boundaries(dev), self.bits, self.centroids(dev), self.norm_correction,
            self.hadamard_signs(dev),
        )

    def compress(self, x: torch.Tensor) -> CompressedTensor:
        """Compress ``x`` of shape ``[..., head_dim]`` (fp16/bf16/fp32, finite)."""
        self.check_input(x)
        packed, norms = self.compress_tensors(x)
        return CompressedTensor(packed, norms, x.shape, x.dtype, self.bits)

    def decompress(self, c: CompressedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reconstruct the tensor ``c`` was made from, in ``dtype`` (default: the original dtype)."""
        if c.bits != self.bits or c.shape[-1] != self.head_dim:
            raise ValueError(
                f"this quantizer has bits={self.bits}, head_dim={self.head_dim}; the CompressedTensor has "
                f"bits={c.bits}, head_dim={c.shape[-1]}"
            )
        dev = c.indices.device
        return ops.decompress(
            c.indices, c.norms, self.rotation(dev), self.centroids(dev), self.bits, self.head_dim,
            dtype or c.dtype, self.hadamard_signs(dev),
        )
