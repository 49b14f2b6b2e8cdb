"""Run-time compilation (CuPy RawModule / NVRTC) and launching of the kernels in ``cuda/``.

Modules are cached per (source, instantiation, device). Local ``#include "x.cuh"`` lines are inlined before
compiling because CuPy's disk cache hashes only the source string: a changed header must change the key.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)
NVRTC_OPTIONS = ("-std=c++17",)


def cuda_source(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """Source of ``cuda/<name>`` with its local includes inlined (each header once)."""
    path = CUDA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} not found (is flashquant-hf installed from a checkout?)")
    seen = _seen | {name}

    def inline(match: re.Match) -> str:
        header = match.group(1)
        return "" if header in seen else cuda_source(header, seen)

    return _INCLUDE.sub(inline, path.read_text())


def _arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    # sm_90a unlocks Hopper-only instructions (wgmma, TMA); NVRTC accepts it for sm_90 parts.
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


@functools.cache
def _kernel(source_name: str, name_expression: str, device_index: int, options: tuple[str, ...]):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=cuda_source(source_name),
            options=NVRTC_OPTIONS + (f"--gpu-architecture={_arch(device_index)}",) + options,
            name_expressions=(name_expression,),
        )
        return module.get_function(name_expression)


def get_kernel(source_name: str, name_expression: str, device: torch.device, options: Sequence[str] = ()):
    """Compiled kernel ``name_expression`` (e.g. ``"tq_compress<128, __nv_bfloat16>"``) from ``cuda/<source_name>``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel(source_name, name_expression, index, tuple(options))


def _as_kernel_arg(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return np.uint64(value.data_ptr())
    if isinstance(value, bool):
        return np.int32(value)
    if isinstance(value, int):
        return np.int32(value)
    if isinstance(value, float):
        return np.float32(value)
    return value


@functools.lru_cache(maxsize=64)
def _external_stream(pointer: int, device_index: int):
    """CuPy view of a torch stream, cached: wrapping it anew costs microseconds on every launch."""
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream in favour of a newer spelling
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(pointer, device_index)


def launch(
    kernel,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: Sequence[Any],
    device: torch.device,
    shared_mem: int = 0,
) -> None:
    """Launch ``kernel`` on PyTorch's current stream of ``device``.

    Tensors are passed as raw device pointers, Python ints as int32 and floats as float32 (a bare Python
    float would become a double). Use ``np.int64`` explicitly for 64-bit values.
    """
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        stream = _external_stream(torch.cuda.current_stream(index).cuda_stream, index)
        kernel(grid, block, tuple(_as_kernel_arg(a) for a in args), shared_mem=shared_mem, stream=stream)
