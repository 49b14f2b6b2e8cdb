"""What the decode kernel tests share: codebooks on the GPU, the code widths, and the decode's math as PyTorch
computes it in the dtype the kernel computes in (the other side of the dtype-relative tolerance)."""

from __future__ import annotations

import torch
from attention_helpers import attention_in_dtype

from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.reference.decompress import dequantize_rotated

DEV = "cuda"
WIDTHS = [(k, v) for k in (1, 2, 3, 4) for v in (1, 2, 3, 4) if (k, v) != (4, 4)]


def centroids(head_dim: int, bits: int = 4) -> torch.Tensor:
    return torch.tensor(lloyd_max_codebook(head_dim, bits).centroids, dtype=torch.float32, device=DEV)


def compute_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """The coarsest dtype the decode kernel rounds to: QK runs in fp16; P V in fp16 for fp16 queries, in bf16
    otherwise (fp32 queries included)."""
    return torch.float16 if query_dtype == torch.float16 else torch.bfloat16


def decode_in_dtype(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                    key_bias=None):
    """The contiguous decode's arguments -> (out [B, Hq, Lq, D], lse [B, Hq, Lq]) of PyTorch attention over the
    dequantized keys and values in ``compute_dtype(q_rot.dtype)``."""
    head_dim = q_rot.shape[-1]
    keys = dequantize_rotated(k_packed, k_norms, k_centroids, k_bits, head_dim)
    values = dequantize_rotated(v_packed, v_norms, v_centroids, v_bits, head_dim)
    bias = None if key_bias is None else key_bias[:, None, None, :]
    return attention_in_dtype(q_rot, keys, values, scale, bias, compute_dtype(q_rot.dtype))
