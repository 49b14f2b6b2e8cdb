"""The backend decision, CUDA kernels or the PyTorch reference, for a device and a requested setting.

A :class:`~flashquant_hf.layer.TurboQuantLayer` decides once, when it is initialised from its config and the device
of its first K/V (:func:`resolve_backend` with ``config.backend``, which the config read from ``FLASHQUANT_BACKEND``
when it was built). :mod:`flashquant_hf.ops` calls made without such a decision use :func:`default_backend`,
the environment variable read once per process. Which kernel serves which specialisation is asked by
:mod:`flashquant_hf.ops`; that module and this one are the only ones that know two implementations exist.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "cuda", "torch")
ENV_VAR = "FLASHQUANT_BACKEND"


def requested_backend() -> str:
    """The backend asked for through ``FLASHQUANT_BACKEND`` now (default ``auto``)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"`{ENV_VAR}` must be one of {BACKENDS}, got {value!r}")
    return value


@functools.cache
def default_backend() -> str:
    """The backend of op calls made without a decided one: ``FLASHQUANT_BACKEND`` as read the first time."""
    return requested_backend()


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


@functools.lru_cache(maxsize=64)
def device_capability(device_index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``device_index`` (cached: launch paths and the attention of every layer ask
    it)."""
    return torch.cuda.get_device_capability(device_index)


def resolve_backend(*tensors: torch.Tensor, requested: str | None = None) -> str:
    """Return ``"cuda"`` or ``"torch"`` for an op on ``tensors``.

    ``requested`` (default: ``FLASHQUANT_BACKEND`` now): ``auto`` takes the kernels when every tensor lives on a
    CUDA device and CuPy imports; ``cuda`` insists and raises a clear error otherwise; ``torch`` always takes the
    reference.
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
