"""Validation of the tensors the kernel wrappers receive: one function per property, one message style.

Every message names the argument, what it must be and what it got, e.g. "`k_packed` must be uint8 of shape
[2, H_kv, N, 64], got float16 [2, 8, 10, 128]". Each wrapper composes these in its own ``_check_*inputs``; the
exception type is the one that wrapper has always raised (``error=`` where it differs from the default).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

# A shape entry is a size or the name of a size the caller does not fix (``"N"`` matches any length).
Dim = int | str


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``."""
    return str(dtype).replace("torch.", "")


def _join(items: Sequence[str], word: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {word} {items[-1]}"


def _shape_text(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def describe(t: object) -> str:
    """``float16 [2, 8, 10, 128]`` for a tensor, its type name for anything else."""
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype)} {list(t.shape)}"
    return type(t).__name__


def check_is_tensor(name: str, t: object) -> torch.Tensor:
    """TypeError unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_cuda(name: str, t: torch.Tensor) -> None:
    """ValueError unless ``t`` lives on a CUDA device."""
    if not t.is_cuda:
        raise ValueError(f"`{name}` must be a CUDA tensor (the kernel reads it on a CUDA device), "
                         f"got a tensor on {t.device}")


def check_device(name: str, t: torch.Tensor, device: torch.device, like: str = "the input") -> None:
    """ValueError unless ``t`` is on ``device`` (the device of ``like``, named in the message)."""
    if t.device != device:
        raise ValueError(f"`{name}` must be on {device} (like {like}), got {t.device}")


def check_dtype(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], error: type[Exception] = ValueError) -> None:
    """``error`` unless ``t.dtype`` is one of ``dtypes``."""
    if t.dtype not in dtypes:
        allowed = _join([dtype_name(d) for d in dtypes])
        raise error(f"`{name}` must have dtype {allowed}, got {dtype_name(t.dtype)}")


def check_rank(name: str, t: torch.Tensor, layout: Sequence[str]) -> None:
    """ValueError unless ``t`` has one dimension per entry of ``layout`` (e.g. ``("B", "Hq", "Lq", "D")``)."""
    if t.dim() != len(layout):
        raise ValueError(f"`{name}` must have {len(layout)} dimensions {_shape_text(layout)}, "
                         f"got shape {list(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], layout: Sequence[str] | None = None) -> None:
    """ValueError unless ``t.shape == shape``; ``layout`` names the dimensions in the message."""
    if tuple(t.shape) != tuple(shape):
        named = f"{_shape_text(layout)} = " if layout is not None else ""
        raise ValueError(f"`{name}` must have shape {named}{list(shape)}, got {list(t.shape)}")


def _matches(t: torch.Tensor, shape: Sequence[Dim]) -> bool:
    return t.dim() == len(shape) and all(isinstance(d, str) or d == n for d, n in zip(shape, t.shape))


def check_layout(name: str, t: object, dtype: torch.dtype, shape: Sequence[Dim]) -> torch.Tensor:
    """ValueError unless ``t`` is a tensor of ``dtype`` and ``shape`` (string entries match any size). One
    message for dtype and shape: a compressed-cache buffer is described by both. A non-tensor raises ValueError
    too (the decode and prefill wrappers always did)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or not _matches(t, shape):
        raise ValueError(f"`{name}` must be {dtype_name(dtype)} of shape {_shape_text(shape)}, got {describe(t)}")
    return t


def check_aligned_rows(name: str, t: torch.Tensor, alignment: int) -> None:
    """ValueError unless the last dim is contiguous and every row starts ``alignment``-byte aligned (vector
    loads). Size-1 dimensions never move the address, so their strides do not count."""
    size = t.element_size()
    misaligned = any(s * size % alignment for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if t.stride(-1) != 1 or t.data_ptr() % alignment or misaligned:
        raise ValueError(
            f"`{name}` needs a contiguous last dimension and {alignment}-byte aligned rows (address and strides), "
            f"got strides {t.stride()} at address % {alignment} = {t.data_ptr() % alignment}"
        )


def _argument_list(tensors: Mapping[str, torch.Tensor]) -> str:
    """The names as "`q`, `k` and `v`"."""
    return _join([f"`{n}`" for n in tensors], "and")


def check_same_dtype(tensors: Mapping[str, torch.Tensor], error: type[Exception] = ValueError) -> None:
    """``error`` unless every tensor of ``{name: tensor}`` has the same dtype."""
    if len({t.dtype for t in tensors.values()}) > 1:
        got = ", ".join(f"`{n}` {dtype_name(t.dtype)}" for n, t in tensors.items())
        raise error(f"{_argument_list(tensors)} must share a dtype, got {got}")


def check_same_device(tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless every tensor of ``{name: tensor}`` is on the same device."""
    if len({t.device for t in tensors.values()}) > 1:
        got = ", ".join(f"`{n}` {t.device}" for n, t in tensors.items())
        raise ValueError(f"{_argument_list(tensors)} must share a device, got {got}")


def check_tensor(
    name: str,
    t: object,
    device: torch.device | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """The usual sequence: a tensor (TypeError), on CUDA, on ``device``, with one of ``dtypes``, of ``shape``
    (each ValueError; ``None`` skips that check). Returns ``t``."""
    t = check_is_tensor(name, t)
    check_cuda(name, t)
    if device is not None:
        check_device(name, t, device)
    if dtypes is not None:
        check_dtype(name, t, dtypes)
    if shape is not None:
        check_shape(name, t, shape)
    return t
