"""The ops of a static-capacity decode step as ``torch.library`` custom ops, so ``torch.compile`` traces a model whose
cache is a static TurboQuantCache as one graph (each op is one opaque node with a fake implementation for shapes)
and CUDA graphs capture it. ``compress_into`` writes into the store it is given and declares so
(``mutates_args``): inductor then calls it on the store itself, with no copy; ``decode_merged`` is functional.

Each op runs the CUDA kernels or the PyTorch reference through :mod:`flashquant_hf.ops` (``backend`` is the
layer's decision); nothing in them synchronises with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .store_layout import split_rows
from .store_rows import check_store_rows

NAMESPACE = "flashquant"


def _codes_and_norms(packed: Tensor, norms: Tensor | None) -> tuple[Tensor, Tensor]:
    """A side's codes and norms; ``norms`` None: ``packed`` is its buffer of inline rows, split here."""
    return split_rows(packed) if norms is None else (packed, norms)


@torch.library.custom_op(f"{NAMESPACE}::compress_into", mutates_args=("packed", "norms"))
def compress_into(
    x: torch.Tensor,
    rotation: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    hadamard_signs: torch.Tensor | None,
    bits: int,
    norm_correction: bool,
    backend: str,
    packed: torch.Tensor,
    norms: torch.Tensor | None,
    start: torch.Tensor,
) -> None:
    """See :func:`flashquant_hf.reference.compress.compress_into`: ``x [..., n, D]`` into rows ``start .. start + n``
    of ``packed [..., N, bytes]`` / ``norms [..., N]``, in place. ``norms`` None: ``packed`` is a store of inline
    norms, rows ``[..., N, bytes + 4]`` uint8 (codes, then the fp32 norm; :mod:`~flashquant_hf.store_layout`), split
    here: float views of it made in a traced graph would be copies, and the norms written into them lost."""
    packed, norms = _codes_and_norms(packed, norms)
    ops.compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, norm_correction, hadamard_signs,
                      backend=backend)


@compress_into.register_fake
def _(x, rotation, boundaries, centroids, hadamard_signs, bits, norm_correction, backend, packed, norms, start):
    # a bad call fails while tracing, not at the first replay
    check_store_rows(x, *_codes_and_norms(packed, norms), start, bits)


@torch.library.custom_op(f"{NAMESPACE}::decode_merged", mutates_args=())
def decode_merged(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor | None, v_packed: Tensor, v_norms: Tensor | None,
    k_centroids: Tensor, v_centroids: Tensor, lengths: Tensor, key_bias: Tensor | None, extra_out: Tensor,
    extra_lse: Tensor, k_bits: int, v_bits: int, scale: float, backend: str,
) -> tuple[Tensor, Tensor]:
    """See :func:`flashquant_hf.reference.decode_merged.decode_merged`. A side whose norms are None keeps them after its
    code rows: its ``*_packed`` is the uint8 rows buffer ``[B, H_kv, N, bytes + 4]`` (split here, not in the traced
    graph, where a float view of it would be a copy of the whole store)."""
    k_packed, k_norms = _codes_and_norms(k_packed, k_norms)
    v_packed, v_norms = _codes_and_norms(v_packed, v_norms)
    return ops.decode_merged(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias,
                             extra_out, extra_lse, k_bits, v_bits, scale, backend=backend)


@decode_merged.register_fake
def _(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias, extra_out, extra_lse,
      k_bits, v_bits, scale, backend):
    batch, q_heads, q_len, head_dim = q_rot.shape
    out = q_rot.new_empty((batch, q_heads, q_len, head_dim), dtype=torch.float32)
    return out, q_rot.new_empty((batch, q_heads, q_len), dtype=torch.float32)
