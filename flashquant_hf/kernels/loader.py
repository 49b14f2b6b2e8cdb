"""Run-time compilation (CuPy RawModule / NVRTC) and launching of the kernels in ``cuda/``.

Modules are cached per (source, instantiation, device). Local ``#include "x.cuh"`` lines are inlined before
compiling because CuPy's disk cache hashes only the source string: a changed header must change the key.

Two launch paths: :func:`launch` (CuPy's argument conversion, any caller) and :func:`launch_cached` (a
``cuLaunchKernel`` parameter array laid out once per kernel, for the per-token / per-chunk attention calls whose
host time is part of their latency), which falls back to :func:`launch`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import re
import struct
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..backend import device_capability

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def _cuda_dir() -> Traversable:
    """The kernel sources: package ``flashquant_hf.cuda`` of an installed wheel (the repository's ``cuda/``
    shipped inside it), else ``cuda/`` of the checkout this package is imported from (editable install or
    ``PYTHONPATH``), which has no such package."""
    try:
        return importlib.resources.files("flashquant_hf.cuda")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "cuda"


CUDA_DIR = _cuda_dir()
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)
NVRTC_OPTIONS = ("-std=c++17",)


def cuda_source(name: str, _seen: frozenset[str] = frozenset()) -> str:
    """Source of ``cuda/<name>`` with its local includes inlined (each header once)."""
    path = CUDA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {name} not found in {CUDA_DIR}")
    seen = _seen | {name}

    def inline(match: re.Match) -> str:
        header = match.group(1)
        return "" if header in seen else cuda_source(header, seen)

    return _INCLUDE.sub(inline, path.read_text())


def _arch(device_index: int) -> str:
    major, minor = device_capability(device_index)
    # sm_90a unlocks Hopper-only instructions (wgmma, TMA); NVRTC accepts it for sm_90 parts.
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def device_index(device: torch.device) -> int:
    """Index of a CUDA device (the current one when ``device`` has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


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
    return _kernel(source_name, name_expression, device_index(device), tuple(options))


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

    index = device_index(device)
    with cupy.cuda.Device(index):
        if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        stream = _external_stream(torch.cuda.current_stream(index).cuda_stream, index)
        kernel(grid, block, tuple(_as_kernel_arg(a) for a in args), shared_mem=shared_mem, stream=stream)


# struct codes of the kernel argument types; every argument gets an 8-byte slot (little-endian, padded).
_CODES = {np.uint64: "Q", np.int64: "q", np.int32: "i4x", np.float32: "f4x"}
_ARG_BLOCKS: dict[int, "ArgBlock"] = {}
_ARG_BLOCK_LIMIT = 1024


def _as_scalar(value: Any) -> np.generic:
    if isinstance(value, torch.Tensor):
        return np.uint64(0)
    if isinstance(value, (bool, int)):
        return np.int32(value)
    if isinstance(value, float):
        return np.float32(value)
    return value


class ArgBlock:
    """``cuLaunchKernel``'s parameter array of one kernel, laid out once from the first call's argument types.

    A call writes every value with one ``struct.pack_into`` (a few microseconds for 39 arguments, against
    ~1 us per argument through CuPy's conversion). A pointer slot takes a tensor (its ``data_ptr()``) or an
    integer address (``np.uint64``) on any call. The lock keeps fill + launch atomic between threads (the driver
    copies the values at launch)."""

    def __init__(self, args: Sequence[Any]) -> None:
        self.pointer_slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) or
                                   isinstance(a, np.uint64))
        self.format = "<" + "".join(_CODES[type(_as_scalar(a))] for a in args)
        self.buffer = ctypes.create_string_buffer(8 * len(args))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * len(args))(*[base + 8 * i for i in range(len(args))])
        self.address = ctypes.addressof(self.params)
        self.lock = threading.Lock()
        self.shared_limit = 48 * 1024  # dynamic shared memory the kernel is known to accept
        # The cuLaunchKernelEx configuration of programmatic launches, built on first use: (CUlaunchConfig, its
        # address, the attribute array it points to)
        self.launch_config: tuple | None = None

    def fill(self, args: Sequence[Any]) -> int:
        """Write ``args`` into the parameter array; returns the address of the ``void*`` array."""
        values = list(args)
        for i in self.pointer_slots:
            value = values[i]
            if isinstance(value, torch.Tensor):
                values[i] = value.data_ptr()
        struct.pack_into(self.format, self.buffer, 0, *values)
        return self.address


def function_ptr(kernel: Any, device_index: int) -> int:
    """The ``CUfunction`` of a CuPy ``RawKernel`` (loaded in ``device_index``'s primary context), or 0 for none."""
    if kernel is None:
        return 0
    import cupy

    with cupy.cuda.Device(device_index):
        function = getattr(kernel, "kernel", kernel)  # RawKernel -> cupy.cuda.Function
        return int(function.ptr)


def clear_arg_blocks() -> None:
    """Forget the cached parameter arrays (they are rebuilt on the next launch of each kernel)."""
    _ARG_BLOCKS.clear()


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(index: int) -> int:
    """The ``cudaStream_t`` of torch's current stream on device ``index``."""
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PROGRAMMATIC_MIN_CAPABILITY = (9, 0)  # programmatic dependent launch: Hopper or newer
CLUSTER_MIN_CAPABILITY = (9, 0)  # thread-block clusters (__cluster_dims__ kernels): Hopper or newer


@functools.cache
def _driver():
    """The driver library with ``cuLaunchKernelEx`` typed, or None."""
    try:
        library = ctypes.CDLL("libcuda.so.1")
        launch_ex = library.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch_ex.restype = ctypes.c_int
    return library


def _programmatic_config(grid: tuple[int, int, int], block: int, shared_mem: int, stream: int,
                         block_args: "ArgBlock") -> tuple:
    """(CUlaunchConfig, its address, its attribute) of a programmatic launch for ``cuLaunchKernelEx``, kept in
    ``block_args`` (building the ctypes structs costs ~2 us per launch)."""
    found = block_args.launch_config
    if found is None:
        attribute = (_LaunchAttribute * 1)(_LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION))
        attribute[0].value.flag = 1
        config = _LaunchConfig(block_y=1, block_z=1, attrs=attribute, num_attrs=1)
        found = block_args.launch_config = (config, ctypes.byref(config), attribute)
    config = found[0]
    config.grid_x, config.grid_y, config.grid_z = grid
    config.block_x, config.shared_mem, config.stream = block, shared_mem, stream
    return found


def _launch_programmatic(block_args: "ArgBlock", function: int, grid: tuple[int, int, int], block: int,
                         shared_mem: int, stream: int, params: int) -> bool:
    """Launch with programmatic stream serialization: the grid may start while the previous kernel in the stream
    is finishing; it must execute ``griddepcontrol.wait`` before touching memory that kernel wrote. False when
    nothing was launched (no ``cuLaunchKernelEx`` in the driver, no current context, or the driver refused the
    attribute): the caller then launches the ordinary way, which reports any real error."""
    driver = _driver()
    if driver is None:
        return False
    config = _programmatic_config(grid, block, shared_mem, stream, block_args)
    return driver.cuLaunchKernelEx(config[1], function, params, None) == 0


def _block_args(kernel, function: int, args: Sequence[Any], device_index: int, shared_mem: int) -> "ArgBlock":
    """The kernel's cached parameter array, with its dynamic shared-memory limit raised to ``shared_mem``."""
    block_args = _ARG_BLOCKS.get(function)
    if block_args is None:
        if len(_ARG_BLOCKS) >= _ARG_BLOCK_LIMIT:
            _ARG_BLOCKS.clear()
        block_args = _ARG_BLOCKS[function] = ArgBlock(args)
    if shared_mem > block_args.shared_limit:  # once per kernel: cuLaunchKernel does not raise the limit itself
        import cupy

        with cupy.cuda.Device(device_index):
            if kernel.max_dynamic_shared_size_bytes < shared_mem:
                kernel.max_dynamic_shared_size_bytes = shared_mem
        block_args.shared_limit = shared_mem
    return block_args


class PreparedLaunch:
    """A launch of one kernel whose arguments stay the same from call to call except its pointers: the parameter
    array holds every value from the first call, and a call rewrites only the pointer slots (one ctypes store each)
    before launching. For the per-token decode, where the host time of a call is part of its latency.

    ``args`` as for :func:`launch_cached`; its tensors mark the pointer slots, which every call passes as integer
    addresses in the same order. Not for CUDA-graph capture of programmatic launches (``programmatic`` is decided
    per call by the caller)."""

    def __init__(self, kernel, function: int, grid: tuple[int, int, int], block: int, args: Sequence[Any],
                 device_index: int, shared_mem: int = 0) -> None:
        self.block_args = ArgBlock(args)
        self.block_args.fill(args)
        self.slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.words = (ctypes.c_uint64 * len(args)).from_buffer(self.block_args.buffer)
        self.function, self.grid, self.block, self.shared_mem = function, grid, block, shared_mem
        self.device_index = device_index
        # cuLaunchKernelEx's handle arguments as ctypes objects, so a call converts nothing
        self.function_arg = ctypes.c_void_p(function)
        self.params_arg = ctypes.c_void_p(self.block_args.address)
        if shared_mem > 48 * 1024:
            import cupy

            with cupy.cuda.Device(device_index):
                if kernel.max_dynamic_shared_size_bytes < shared_mem:
                    kernel.max_dynamic_shared_size_bytes = shared_mem
        # cuLaunchKernelEx and its configuration, built once: a programmatic call only sets the stream
        driver = _driver()
        self.programmatic_config = None
        if driver is not None and device_capability(device_index) >= PROGRAMMATIC_MIN_CAPABILITY:
            config, reference, _ = _programmatic_config(grid, block, shared_mem, 0, self.block_args)
            self.programmatic_config = (config, reference, driver.cuLaunchKernelEx)

    def write(self, pointers: Sequence[int]) -> None:
        """Write ``pointers`` (one address per tensor of the first call's ``args``, in order) into the parameter
        array (hold ``block_args.lock`` until the launch)."""
        words = self.words
        for slot, pointer in zip(self.slots, pointers):
            words[slot] = pointer

    def launch(self, stream: int, programmatic: bool) -> None:
        """Launch with the parameter array as written on ``stream`` (a raw ``cudaStream_t`` of the kernel's
        device, which must be torch's current one: the kernel lives in its primary context)."""
        if programmatic and self.programmatic_config is not None:
            config, reference, launch_ex = self.programmatic_config
            config.stream = stream
            if launch_ex(reference, self.function_arg, self.params_arg, None) == 0:
                return
        import cupy

        cupy.cuda.driver.launchKernel(self.function, *self.grid, self.block, 1, 1, self.shared_mem, stream,
                                      self.block_args.address, 0)

    def __call__(self, pointers: Sequence[int], programmatic: bool) -> None:
        """Write ``pointers`` (see :meth:`write`) and launch on torch's current stream."""
        with self.block_args.lock:
            self.write(pointers)
            self.launch(raw_stream(self.device_index), programmatic)


def launch_cached(kernel, function: int, grid: tuple[int, int, int], block: int, args: Sequence[Any],
                  device_index: int, shared_mem: int = 0, fast: bool = True, programmatic: bool = False) -> None:
    """Launch ``kernel`` (CUfunction ``function``, see :func:`function_ptr`) on torch's current stream of
    ``device_index`` through its cached parameter array.

    Falls back to :func:`launch` (CuPy's conversion) when ``fast`` is off, torch's current device is another one,
    or the driver refuses the context before launching. Every call of one kernel must pass the same argument
    types (pointers as tensors or ``np.uint64``, ``np.int64`` / int / float scalars). Kernels with compile-time
    ``__cluster_dims__`` launch like any other (the cluster shape is not a launch attribute). ``programmatic``
    launches through ``cuLaunchKernelEx`` with programmatic stream serialization (programmatic dependent launch)
    for kernels that wait on their predecessor with ``griddepcontrol.wait``; on GPUs older than
    ``PROGRAMMATIC_MIN_CAPABILITY`` the launch is an ordinary one.
    """
    if fast and torch.cuda.current_device() == device_index:
        import cupy

        block_args = _block_args(kernel, function, args, device_index, shared_mem)
        try:
            # The kernel lives in the device's primary context, current once torch has used the device here.
            with block_args.lock:
                params = block_args.fill(args)
                stream = raw_stream(device_index)
                if (programmatic and device_capability(device_index) >= PROGRAMMATIC_MIN_CAPABILITY
                        and _launch_programmatic(block_args, function, grid, block, shared_mem, stream, params)):
                    return
                cupy.cuda.driver.launchKernel(
                    function, grid[0], grid[1], grid[2], block, 1, 1, shared_mem, stream, params, 0,
                )
            return
        except cupy.cuda.driver.CUDADriverError as error:  # e.g. no current context on this thread: nothing ran
            if "CONTEXT" not in str(error):
                raise
    launch(kernel, grid, (block,), args, torch.device("cuda", device_index), shared_mem=shared_mem)
