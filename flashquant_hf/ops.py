"""Public ops: each call is routed to the CUDA kernel or the PyTorch reference of the same name.

This module and :mod:`flashquant_hf.backend` are the only places that know two implementations exist.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from .backend import requested_backend, resolve_backend

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def implementation(op: str, *tensors: torch.Tensor, backend: str = "auto") -> ModuleType:
    """The module (``kernels.<op>`` or ``reference.<op>``) that runs ``op`` on ``tensors``.

    ``backend`` is a cache's setting: ``auto`` follows ``FLASHQUANT_BACKEND`` and the tensors' device, ``torch``
    pins the reference, ``cuda`` first checks that the kernels can run on ``tensors``.
    """
    if backend == "torch":
        return importlib.import_module(f"flashquant_hf.reference.{op}")
    if backend == "cuda":
        resolve_backend(*tensors, requested="cuda")
    if resolve_backend(*tensors) == "torch":
        return importlib.import_module(f"flashquant_hf.reference.{op}")
    try:
        return importlib.import_module(f"flashquant_hf.kernels.{op}")
    except ModuleNotFoundError as error:
        if error.name != f"flashquant_hf.kernels.{op}" or requested_backend() == "cuda":
            raise
        if op not in _warned:
            _warned.add(op)
            logger.warning("flashquant-hf has no CUDA kernel for `%s` yet; using the PyTorch reference", op)
        return importlib.import_module(f"flashquant_hf.reference.{op}")


def compress(x, rotation, boundaries, bits, centroids=None, norm_correction=False, hadamard_signs=None):
    """See :func:`flashquant_hf.reference.compress.compress`."""
    return implementation("compress", x).compress(
        x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs
    )


def decompress(packed, norms, rotation, centroids, bits, head_dim, dtype=torch.float32, hadamard_signs=None):
    """See :func:`flashquant_hf.reference.decompress.decompress`."""
    return implementation("decompress", packed).decompress(
        packed, norms, rotation, centroids, bits, head_dim, dtype, hadamard_signs
    )


def tq_attention(
    q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal=False, key_bias=None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    return implementation("tq_attention", q_rot, k_packed).tq_attention(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )


def merge_partials(outs, lses):
    """See :func:`flashquant_hf.reference.merge_partials.merge_partials`."""
    return implementation("merge_partials", outs).merge_partials(outs, lses)
