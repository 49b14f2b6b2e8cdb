"""Public ops: each call runs the CUDA kernel or the PyTorch reference of the same name, chosen here.

This module and :mod:`flashquant_hf.backend` are the only ones that choose between the two. Every op takes
``backend``: ``"cuda"`` or ``"torch"`` as its caller decided once (a TurboQuantLayer, when it is initialised), or
None for a direct call, which :func:`~flashquant_hf.backend.default_backend` (``FLASHQUANT_BACKEND`` read once
per process) and the tensors' device decide. On ``"cuda"`` an op first asks its kernel module whether a kernel
serves the call (``unsupported(...)``: a reason, or None) and otherwise runs the reference, saying so once. On
``"torch"`` with CPU tensors, an op that has a CPU implementation (``flashquant_hf.cpu.<module>``: the reference's
results in fewer, larger ops) runs it where its ``unsupported(...)`` gives no reason, and a TurboQuantLayer
attends over its whole context in one softmax (:func:`attends_in_one_softmax`).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from .backend import BACKENDS, default_backend, resolve_backend
from .log import warn_once

logger = logging.getLogger(__name__)

DECIDED = ("cuda", "torch")
CPU_OPS = ("dequantize_rotated", "centroid_values")  # ops with an implementation in flashquant_hf/cpu/<module>.py


def implementation(module: str, *tensors: torch.Tensor, backend: str | None = None) -> ModuleType:
    """``flashquant_hf.kernels.<module>`` or ``flashquant_hf.reference.<module>``, for an op on ``tensors``.

    ``backend``: ``"cuda"`` / ``"torch"`` as decided by the caller; ``"auto"`` decides from ``tensors``; None
    also decides from ``tensors``, with the process default (:func:`~flashquant_hf.backend.default_backend`).
    """
    return importlib.import_module(f"flashquant_hf.{_package(backend, tensors)}.{module}")


def _package(backend: str | None, tensors: tuple[torch.Tensor, ...]) -> str:
    if backend not in DECIDED:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS} or None, got {backend!r}")
        backend = resolve_backend(*tensors, requested=backend or default_backend())
    return "kernels" if backend == "cuda" else "reference"


def _reference_unless_served(op: str, module: str, backend: str | None, tensors: tuple, *question) -> ModuleType:
    """The kernel module of ``op`` unless the backend is the reference or the kernel module answers
    ``unsupported(*question)`` with a reason (then the reference, logged once per reason)."""
    package = _package(backend, tensors)
    if package == "kernels":
        kernel = importlib.import_module(f"flashquant_hf.kernels.{module}")
        reason = kernel.unsupported(*question)
        if reason is None:
            return kernel
        warn_once(logger, f"flashquant-hf has no CUDA `{op}` kernel for {reason}; using the PyTorch reference")
    elif op in CPU_OPS and all(t.device.type == "cpu" for t in tensors):
        cpu = importlib.import_module(f"flashquant_hf.cpu.{module}")
        if cpu.unsupported(*question) is None:
            return cpu
    return importlib.import_module(f"flashquant_hf.reference.{module}")


def attends_in_one_softmax(backend: str, query: torch.Tensor) -> bool:
    """Whether a TurboQuantLayer on ``backend`` attends ``query`` over its sinks, compressed part and window in one
    torch softmax (the CPU: a few large ops per layer) instead of ``tq_attention`` + ``merge_partials``."""
    return backend == "torch" and query.device.type == "cpu"


def compress(
    x, rotation, boundaries, bits, centroids=None, norm_correction=False, hadamard_signs=None, *,
    backend: str | None = None, split_code: bool = False,
):
    """See :func:`flashquant_hf.reference.compress.compress`; ``split_code``: ``x`` is one part of a split code
    (:class:`~flashquant_hf.codec.HeadCodec`)."""
    module = _reference_unless_served("compress", "compress", backend, (x,), x.shape[-1], bits, split_code)
    return module.compress(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs)


def compress_into(
    x, rotation, boundaries, bits, packed, norms, start, centroids=None, norm_correction=False, hadamard_signs=None,
    *, backend: str | None = None,
):
    """See :func:`flashquant_hf.reference.compress.compress_into` (in place; returns None)."""
    module = _reference_unless_served("compress", "compress", backend, (x,), x.shape[-1], bits)
    module.compress_into(x, rotation, boundaries, bits, packed, norms, start, centroids, norm_correction,
                         hadamard_signs)


def decompress(
    packed, norms, rotation, centroids, bits, head_dim, dtype=torch.float32, hadamard_signs=None, *,
    backend: str | None = None,
):
    """See :func:`flashquant_hf.reference.decompress.decompress`."""
    module = _reference_unless_served("decompress", "decompress", backend, (packed,), head_dim, bits)
    return module.decompress(packed, norms, rotation, centroids, bits, head_dim, dtype, hadamard_signs)


def dequantize_rotated(packed, norms, centroids, bits, head_dim, *, backend: str | None = None):
    """See :func:`flashquant_hf.reference.decompress.dequantize_rotated` (fp32 ``[..., head_dim]``)."""
    module = _reference_unless_served("dequantize_rotated", "decompress", backend, (packed,), head_dim, bits)
    return module.dequantize_rotated(packed, norms, centroids, bits, head_dim)


def centroid_values(packed, centroids, bits, head_dim, *, backend: str | None = None):
    """See :func:`flashquant_hf.reference.decompress.centroid_values` (no kernel: the torch products of the codecs
    read it)."""
    module = _reference_unless_served("centroid_values", "decompress", "torch", (packed,), head_dim, bits)
    return module.centroid_values(packed, centroids, bits, head_dim)


def tq_attention(
    q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal=False, key_bias=None, *, backend: str | None = None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    module = _reference_unless_served("tq_attention", "tq_attention", backend, (q_rot, k_packed), k_bits, v_bits,
                                      q_rot.shape[2], q_rot.shape[-1])
    return module.tq_attention(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )


def merge_partials(outs, lses, *, backend: str | None = None):
    """See :func:`flashquant_hf.reference.merge_partials.merge_partials`."""
    return implementation("merge_partials", outs, backend=backend).merge_partials(outs, lses)


def decode_merged(
    q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias, extra_out, extra_lse,
    k_bits, v_bits, scale, *, backend: str | None = None,
):
    """See :func:`flashquant_hf.reference.decode_merged.decode_merged`."""
    module = _reference_unless_served("decode_merged", "decode_merged", backend, (q_rot, k_packed), k_bits, v_bits,
                                      q_rot.shape[-1])
    return module.decode_merged(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, lengths, key_bias, extra_out,
        extra_lse, k_bits, v_bits, scale,
    )
