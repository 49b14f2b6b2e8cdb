"""The ops of a static-capacity decode step as ``torch.library`` custom ops, so ``torch.compile`` traces a model whose
cache is a static TurboQuantCache as one graph (each op is one opaque node with a fake implementation for shapes)
and CUDA graphs capture it. The ops are functional (they return new tensors, which the layer writes into its
store with ``index_copy_``, as transformers' StaticLayer writes its keys): no op mutates an input, so the compiler
has no copy of a mutated store to avoid.

Each op runs the CUDA kernels or the PyTorch reference through :mod:`flashquant_hf.ops` (``backend`` is the
layer's decision); nothing in them synchronises with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .packing import packed_size

NAMESPACE = "flashquant"


@torch.library.custom_op(f"{NAMESPACE}::compress", mutates_args=())
def compress(
    x: torch.Tensor,
    rotation: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    hadamard_signs: torch.Tensor | None,
    bits: int,
    norm_correction: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`flashquant_hf.reference.compress.compress` (``x`` ``[..., D]``)."""
    return ops.compress(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs, backend=backend)


@compress.register_fake
def _(x, rotation, boundaries, centroids, hadamard_signs, bits, norm_correction, backend):
    lead = tuple(x.shape[:-1])
    packed = x.new_empty(lead + (packed_size(x.shape[-1], bits),), dtype=torch.uint8)
    return packed, x.new_empty(lead, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::decode_merged", mutates_args=())
def decode_merged(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, lengths: Tensor, key_bias: Tensor | None, extra_out: Tensor, extra_lse: Tensor, k_bits: int,
    v_bits: int, scale: float, backend: str,
) -> tuple[Tensor, Tensor]:
    """See :func:`flashquant_hf.reference.decode_merged.decode_merged`."""
    return ops.decode_merged(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias,
                             extra_out, extra_lse, k_bits, v_bits, scale, backend=backend)


@decode_merged.register_fake
def _(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias, extra_out, extra_lse,
      k_bits, v_bits, scale, backend):
    batch, q_heads, q_len, head_dim = q_rot.shape
    out = q_rot.new_empty((batch, q_heads, q_len, head_dim), dtype=torch.float32)
    return out, q_rot.new_empty((batch, q_heads, q_len), dtype=torch.float32)
