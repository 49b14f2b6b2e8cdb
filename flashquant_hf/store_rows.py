"""The arguments of ``compress_into``: a block of head vectors ``x [..., n, D]`` and the store rows it is written to,
``start .. start + n`` along the slot dimension of ``packed [..., N, bytes]`` / ``norms [..., N]``. The reference, the
kernel wrapper and the custom op's fake implementation check them alike, before anything is written.

``start`` lives in device memory (a static cache's counter), so its value is checked only where reading it does not
synchronise with the host: a CPU ``start``.
"""

from __future__ import annotations

import torch

from .packing import packed_size


def check_store_rows(x: object, packed: object, norms: object, start: object, bits: int) -> int:
    """The block length ``n``, or a ValueError (TypeError for a non-tensor) naming the argument that does not fit."""
    for name, t in (("x", x), ("packed", packed), ("norms", norms), ("start", start)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 2:
        raise ValueError(f"`x` must have the shape [..., n, head_dim] of a block of rows, got {list(x.shape)}")
    lead, n = tuple(x.shape[:-2]), x.shape[-2]
    row_bytes = packed_size(x.shape[-1], bits)
    if packed.dtype != torch.uint8 or packed.dim() != x.dim() or tuple(packed.shape[:-2]) != lead \
            or packed.shape[-1] != row_bytes:
        raise ValueError(f"`packed` must be uint8 of shape {_shape(lead + ('N', row_bytes))} (x's leading shape, N "
                         f"slots, {row_bytes} bytes per row), got {_describe(packed)}")
    slots = packed.shape[-2]
    if norms.dtype != torch.float32 or tuple(norms.shape) != lead + (slots,):
        raise ValueError(f"`norms` must be float32 of shape {_shape(lead + (slots,))} (packed's slots), got "
                         f"{_describe(norms)}")
    if slots < n:
        raise ValueError(f"the store has {slots} slots per row of `packed`, fewer than the {n} rows of `x`")
    if start.dtype != torch.int64 or start.numel() != 1 or start.dim() > 1:
        raise ValueError(f"`start` must be an int64 tensor of one element (0-dim or [1]), got {_describe(start)}")
    devices = {t.device for t in (x, packed, norms, start)}
    if len(devices) > 1:
        raise ValueError(f"`x`, `packed`, `norms` and `start` must share a device, got {x.device}, {packed.device}, "
                         f"{norms.device} and {start.device}")
    return n


def check_start_value(start: torch.Tensor, n: int, slots: int) -> None:
    """ValueError unless the CPU tensor ``start`` holds a first row in ``[0, slots - n]``."""
    first = int(start.reshape(()))
    if not 0 <= first <= slots - n:
        raise ValueError(f"`start` must be in [0, {slots - n}] to write {n} rows into {slots} slots, got {first}")


def _shape(dims: tuple) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {_shape(tuple(t.shape))}"
