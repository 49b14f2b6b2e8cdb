"""How a TurboQuantLayer codes its keys or its values: one TurboQuant code over every channel, or a split code.

Two levers of the paper split the code (both off by default; docs/quality.md has their measured effect):

* **outlier channels** (the paper's 2.5- and 3.5-bit modes): the ``outlier_channels`` channels of each head with
  the largest mean square on the first prefill (after centring) get a code of one bit more, with their own norm,
  rotation and codebook; the other channels keep ``bits``.
* **QJL residual** (TurboQuant_prod, keys): a ``bits - 1``-bit MSE code plus the signs of a Gaussian sketch of the
  residual ``r = k - k_mse`` and ``||r||`` (:class:`~flashquant_hf.qjl.QJLSketch`). The estimate of ``<q, r>`` is
  linear in ``q``, so it equals ``<q, r_hat>`` with ``r_hat = sqrt(pi/2) / m * ||r|| * S^T sign(S r)``: decoding
  returns ``k_mse + r_hat`` and the attention over the decoded keys is the unbiased TurboQuant_prod score.

A plain code's tensors are ``(packed, norms)``, the layout the CUDA kernels read. A split code's tensors are
``(packed, norms)`` per part, then ``(signs, residual norms)`` with QJL; no kernel reads them, so split codes run
on the PyTorch reference (:mod:`flashquant_hf.ops` decides, and says so once on a GPU). The products here
(:meth:`HeadCodec.dot`, :meth:`HeadCodec.weighted_sum`, :meth:`HeadCodec.decode`) are the attention's exact
torch path: they read each part's centroids (``ops.centroid_values``) and scale scores and weights by the norms.
"""

from __future__ import annotations

import functools

import torch

from . import ops
from .packing import unpack_indices
from .qjl import QJLSketch
from .quantizer import TurboQuantizer


@functools.lru_cache(maxsize=None)
def quantizer(head_dim: int, bits: int, seed: int, rotation: str, norm_correction: bool) -> TurboQuantizer:
    """One shared TurboQuantizer per setting, so every layer reuses its rotation and codebook tensors."""
    return TurboQuantizer(head_dim, bits=bits, seed=seed, rotation=rotation, norm_correction=norm_correction)


def split_problem(head_dim: int, outlier_channels: int, qjl: bool, rotation: str) -> str | None:
    """Why this code cannot serve ``head_dim``-vectors (a sentence), or None."""
    if outlier_channels:
        regular = head_dim - outlier_channels
        if outlier_channels % 2 or outlier_channels < 4 or regular < 4:
            return (
                f"`outlier_channels` must be an even number from 4 to head_dim - 4 = {head_dim - 4}, "
                f"got {outlier_channels}"
            )
        if rotation == "hadamard" and (outlier_channels & (outlier_channels - 1) or regular & (regular - 1)):
            return (
                f"`rotation='hadamard'` needs power-of-two parts, but `outlier_channels={outlier_channels}` splits "
                f"head_dim {head_dim} into {outlier_channels} + {regular}; use rotation='haar'"
            )
    if qjl and head_dim % 8:
        return f"`key_qjl` needs a head_dim that is a multiple of 8 (whole sign bytes), got {head_dim}"
    return None


class HeadCodec:
    """Codes ``[B, H, n, head_dim]`` vectors of one tensor kind with ``bits`` bits per coordinate on average
    (plus ``outlier_channels / head_dim`` with outlier channels).

    Parameters
    ----------
    head_dim, bits, seed, rotation, norm_correction : as in :class:`~flashquant_hf.TurboQuantizer`
    outlier_channels : channels per head coded with ``bits + 1`` bits (0: none)
    qjl : code ``bits - 1`` bits with the MSE quantizer and spend the last bit on a QJL sketch of the residual
    """

    def __init__(
        self,
        head_dim: int,
        bits: int,
        seed: int,
        rotation: str,
        norm_correction: bool,
        outlier_channels: int = 0,
        qjl: bool = False,
    ):
        problem = split_problem(head_dim, outlier_channels, qjl, rotation)
        if problem is not None:
            raise ValueError(problem)
        code_bits = bits - 1 if qjl else bits
        if outlier_channels:
            layout = ((outlier_channels, code_bits + 1), (head_dim - outlier_channels, code_bits))
        else:
            layout = ((head_dim, code_bits),)
        self.head_dim = head_dim
        self.outlier_channels = outlier_channels
        self.parts = tuple(quantizer(size, b, seed, rotation, norm_correction) for size, b in layout)
        self.sketch = QJLSketch(head_dim, seed=seed) if qjl else None

    def __repr__(self) -> str:
        parts = ", ".join(f"{tq.head_dim} ch x {tq.bits} bits" for tq in self.parts)
        return f"HeadCodec([{parts}]{', QJL residual' if self.sketch else ''})"

    @property
    def is_plain(self) -> bool:
        """One TurboQuant code over every channel: the layout the CUDA kernels read."""
        return len(self.parts) == 1 and self.sketch is None

    @property
    def quantizer(self) -> TurboQuantizer:
        """The quantizer of a plain code (what the kernels need: rotation, codebook, bits)."""
        if not self.is_plain:
            raise AttributeError(f"{self} is a split code: it has no single quantizer")
        return self.parts[0]

    @property
    def tensor_count(self) -> int:
        """Tensors per coded token range: (packed, norms) per part, (signs, residual norms) with QJL."""
        return 2 * len(self.parts) + (2 if self.sketch else 0)

    # ---- channel order (outlier channels first)
    def channel_order(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[B, H, head_dim]`` int64: the outlier channels of each head (largest mean square over the tokens of
        ``x [B, H, n, head_dim]``, descending), then the others in ascending order; None without outliers."""
        if not self.outlier_channels:
            return None
        energy = x.float().square().mean(dim=2)
        outliers = energy.topk(self.outlier_channels, dim=-1).indices
        is_outlier = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, outliers, True)
        # A stable sort on "not an outlier" keeps the other channels in ascending order after the outliers.
        regular = torch.sort(is_outlier.to(torch.uint8), dim=-1, stable=True).indices[..., : -self.outlier_channels]
        return torch.cat([outliers, regular], dim=-1)

    def _parts_of(self, x: torch.Tensor, order: torch.Tensor | None) -> list[torch.Tensor]:
        """``x [B, H, M, head_dim]`` split into the channels of each part."""
        if order is None:
            return [x]
        permuted = x.gather(-1, order[:, :, None, :].expand(x.shape))
        return list(permuted.split([tq.head_dim for tq in self.parts], dim=-1))

    def _joined(self, parts: list[torch.Tensor], order: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`_parts_of`."""
        if order is None:
            return parts[0]
        permuted = torch.cat(parts, dim=-1)
        return torch.empty_like(permuted).scatter_(-1, order[:, :, None, :].expand(permuted.shape), permuted)

    # ---- coding
    def encode(self, x: torch.Tensor, order: torch.Tensor | None, compress) -> tuple[torch.Tensor, ...]:
        """Code ``x [B, H, n, head_dim]``; ``compress(tq, x_part) -> (packed, norms)`` runs one quantizer."""
        tensors: list[torch.Tensor] = []
        for tq, part in zip(self.parts, self._parts_of(x, order)):
            tensors.extend(compress(tq, part))
        if self.sketch is not None:
            tensors.extend(self.sketch.encode(x.float() - self._decode_mse(tensors, order)))
        return tuple(tensors)

    def _code_parts(self, tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each part as (unit-norm code in its rotated space, fp32 ``[B, H, N, part dims]``; norms ``[B, H, N]``):
        the products scale N scores or weights by the norms instead of N x part dims coordinates."""
        dev = tensors[0].device
        return [
            (ops.centroid_values(tensors[2 * i], tq.centroids(dev), tq.bits, tq.head_dim), tensors[2 * i + 1])
            for i, tq in enumerate(self.parts)
        ]

    def _residual(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """QJL: (signs as +-1 fp32 ``[B, H, N, m]``, ``sqrt(pi/2) / m * ||r||`` ``[B, H, N]``)."""
        signs, norms = tensors[-2:]
        sketch = self.sketch
        values = unpack_indices(signs, 1, sketch.m).float() * 2 - 1
        return values, norms * (torch.pi / 2) ** 0.5 / sketch.m

    def _decode_mse(self, tensors, order: torch.Tensor | None) -> torch.Tensor:
        dev = tensors[0].device
        codes = zip(self._code_parts(tensors), self.parts)
        return self._joined([(unit * norms.unsqueeze(-1)) @ tq.rotation(dev) for (unit, norms), tq in codes], order)

    def decode(self, tensors: tuple[torch.Tensor, ...], order: torch.Tensor | None) -> torch.Tensor:
        """The vectors the code stands for, fp32 ``[B, H, N, head_dim]`` (with QJL: ``k_mse + r_hat``)."""
        dev = tensors[0].device
        out = self._decode_mse(tensors, order)
        if self.sketch is not None:
            signs, weight = self._residual(tensors)
            out = out + (signs * weight.unsqueeze(-1)) @ self.sketch.projection(dev)
        return out

    # ---- attention products without rebuilding the vectors in model space
    def dot(self, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], order: torch.Tensor | None) -> torch.Tensor:
        """``q . x_hat`` for every pair: ``q`` fp32 ``[B, H, M, head_dim]`` -> ``[B, H, M, N]``.

        Each part is multiplied in its rotated space (the query is rotated, not the N coded vectors).
        """
        dev = q.device
        scores = None
        for q_part, (unit, norms), tq in zip(self._parts_of(q, order), self._code_parts(tensors), self.parts):
            part = ((q_part @ tq.rotation(dev).T) @ unit.transpose(-1, -2)) * norms.unsqueeze(-2)
            scores = part if scores is None else scores + part
        if self.sketch is not None:
            signs, weight = self._residual(tensors)
            projected = q @ self.sketch.projection(dev).T
            scores = scores + (projected @ signs.transpose(-1, -2)) * weight.unsqueeze(-2)
        return scores

    def weighted_sum(
        self, p: torch.Tensor, tensors: tuple[torch.Tensor, ...], order: torch.Tensor | None
    ) -> torch.Tensor:
        """``p @ x_hat``: weights fp32 ``[B, H, M, N]`` -> ``[B, H, M, head_dim]`` (rotated back once per part)."""
        dev = p.device
        outs = [
            ((p * norms.unsqueeze(-2)) @ unit) @ tq.rotation(dev)
            for (unit, norms), tq in zip(self._code_parts(tensors), self.parts)
        ]
        out = self._joined(outs, order)
        if self.sketch is not None:
            signs, weight = self._residual(tensors)
            out = out + (p * weight.unsqueeze(-2)) @ signs @ self.sketch.projection(dev)
        return out


@functools.lru_cache(maxsize=None)
def head_codec(
    head_dim: int, bits: int, seed: int, rotation: str, norm_correction: bool, outlier_channels: int, qjl: bool
) -> HeadCodec:
    """One shared HeadCodec per setting (its quantizers cache their rotation and codebook tensors per device)."""
    return HeadCodec(head_dim, bits, seed, rotation, norm_correction, outlier_channels, qjl)

