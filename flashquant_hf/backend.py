"""The one backend switch: CUDA kernels or the PyTorch reference, decided here and nowhere else."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "cuda", "torch")
ENV_VAR = "FLASHQUANT_BACKEND"


def requested_backend() -> str:
    """The backend asked for through ``FLASHQUANT_BACKEND`` (default ``auto``)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"`{ENV_VAR}` must be one of {BACKENDS}, got {value!r}")
    return value


@functools.cache
def cupy_available() -> bool:
    """Whether CuPy can be imported (checked once)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # a broken CuPy install (no CUDA driver, wrong wheel) counts as absent
        return False
    return True


def resolve_backend(*tensors: torch.Tensor, requested: str | None = None) -> str:
    """Return ``"cuda"`` or ``"torch"`` for an op on ``tensors``.

    ``auto`` takes the kernels when every tensor lives on a CUDA device and CuPy imports; ``cuda`` insists
    and raises a clear error otherwise; ``torch`` always takes the reference.
    """
    choice = requested or requested_backend()
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if choice == "torch":
        return "torch"
    if choice == "cuda":
        if not on_cuda:
            devices = sorted({str(t.device) for t in tensors})
            raise RuntimeError(
                f"{ENV_VAR}=cuda needs every tensor on a CUDA device, got tensors on {devices}"
            )
        if not cupy_available():
            raise RuntimeError(
                f"{ENV_VAR}=cuda needs CuPy: pip install 'flashquant-hf[cuda]' (cupy-cuda13x, or cupy-cuda12x)"
            )
        return "cuda"
    return "cuda" if on_cuda and cupy_available() else "torch"
