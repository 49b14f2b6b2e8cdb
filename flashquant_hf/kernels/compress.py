"""CUDA ``compress`` (``cuda/compress.cu``): norm + rotation + bucketize + bit packing in one launch; ``compress_into``
writes the same codes straight into rows of a store whose first row is read from device memory. The store's rows may
lie any uniform pitch apart (:func:`store_pitches`): contiguous ``packed`` / ``norms``, or rows that hold their codes
and fp32 norm side by side in one uint8 buffer.

Same signature and results as :func:`flashquant_hf.reference.compress.compress`, except that an index may
differ where a rotated coordinate lies within float rounding (~1e-7) of a boundary. With ``hadamard_signs``
the rotation runs as a Walsh-Hadamard transform (the kernel then trusts that ``rotation`` equals
``H diag(s) / sqrt(D)``): on tensor cores for fp16/bf16 inputs at head_dim 64 and 128 (exact +-1 products,
fp32 accumulation), as a fast transform in registers and shuffles otherwise. Without them ``rotation`` is
used as a dense fp32 matrix.

Head dims and bit widths outside :data:`HEAD_DIMS` x :data:`BITS` have no kernel (:func:`unsupported` says why;
:mod:`flashquant_hf.ops` then runs the PyTorch reference). Importing this module does not import CuPy.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..codebook import SUPPORTED_BITS
from ..packing import packed_size
from ..store_rows import check_store_rows
from . import loader
from .checks import check_tensor
from .loader import device_index

CUDA_SOURCE = "compress.cu"

# The one table of supported specialisations; decompress.py builds its instantiations from it too.
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
BITS: tuple[int, ...] = (2, 3, 4)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float32: "float",
}
SUPPORTED: tuple[tuple[int, int, torch.dtype], ...] = tuple(itertools.product(HEAD_DIMS, BITS, DTYPE_NAMES))
ROTATION_PATHS: tuple[str, ...] = ("hadamard", "dense")


def kernel_name(path: str, head_dim: int, bits: int, dtype: torch.dtype) -> str:
    """Name expression of one compress instantiation, e.g. ``tq_compress_hadamard<128, 4, __nv_bfloat16>``."""
    return f"tq_compress_{path}<{head_dim}, {bits}, {DTYPE_NAMES[dtype]}>"


NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    kernel_name(path, d, b, t) for path in ROTATION_PATHS for d, b, t in SUPPORTED
)

THREADS = 256


def hadamard_lanes(head_dim: int, dtype: torch.dtype) -> int:
    """Threads per row of the FWHT variant of ``tq_compress_hadamard`` (cuda/compress.cu ``hadamard_lanes``):
    16 coordinates per thread, 32 for 16-bit inputs at head_dim 128."""
    if head_dim == 128 and dtype != torch.float32:
        return 4
    return {64: 4, 128: 8, 256: 16}[head_dim]


def hadamard_uses_mma(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``tq_compress_hadamard`` runs its tensor-core transform (cuda/compress.cu ``hadamard_mma``):
    16-bit inputs at head_dim 64 or 128."""
    return head_dim in (64, 128) and dtype in (torch.float16, torch.bfloat16)


MMA_THREADS = 128  # threads per CTA of the tensor-core transform (cuda/compress.cu MMA_THREADS)
MMA_ROWS = 8  # rows per warp and loop iteration (MMA_ROWS)


def hadamard_launch(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(threads per CTA, rows per CTA and loop iteration) of ``tq_compress_hadamard`` (cuda/compress.cu
    ``HadamardLaunch``: the tensor-core kernel gives each warp MMA_ROWS rows)."""
    if hadamard_uses_mma(head_dim, dtype):
        return MMA_THREADS, MMA_THREADS // 32 * MMA_ROWS
    return THREADS, THREADS // hadamard_lanes(head_dim, dtype)


# Dense kernel: rows per tile, dynamic shared memory, and CTAs that fit on one SM (registers / shared memory).
_DENSE_ROWS = {64: 128, 128: 64, 256: 64}
_DENSE_CTAS_PER_SM = {64: 2, 128: 2, 256: 1}
# Persistent grids: enough CTAs per SM that the last wave is short.
_WAVES = 16


def dense_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of ``tq_compress_dense<head_dim, ...>`` (rotation rows + staged input tile)."""
    ncol = min(head_dim, 128)
    rows = _DENSE_ROWS[head_dim]
    return (ncol * head_dim + head_dim * rows + 2 * rows + THREADS) * 4


@functools.cache
def sm_count(device_index: int) -> int:
    """Multiprocessors of a CUDA device (cached)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fast_divider(divisor: int) -> tuple[np.uint32, np.uint32, np.uint32]:
    """(divisor, magic, shift) with ``n // divisor == (umulhi(n, magic) + n) >> shift`` for 0 <= n < 2^31.

    The round-up multiply-high division of Granlund and Montgomery (as in PyTorch's IntDivider); the kernels
    use it to split a row index into its leading-dimension indices without hardware division.
    """
    if not 1 <= divisor < 2**31:
        raise ValueError(f"a leading dimension must be in [1, 2^31), got {divisor}")
    shift = max(0, (divisor - 1).bit_length())
    magic = ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1
    return np.uint32(divisor), np.uint32(magic), np.uint32(shift)


def collapse_rows(
    shape: Sequence[int], *strides: Sequence[int], max_dims: int = 3
) -> tuple[list[int], list[list[int]]] | None:
    """Collapse leading dimensions that several tensors traverse alike.

    ``shape`` are the leading sizes shared by the tensors, ``strides`` one list of element strides per tensor.
    Returns ``(sizes, strides_per_tensor)`` with exactly ``max_dims`` entries each (outer ones padded with size 1),
    or None when more than ``max_dims`` dimensions remain.
    """
    merged: list[tuple[int, list[int]]] = []
    for i, size in enumerate(shape):
        if size == 1:
            continue
        st = [s[i] for s in strides]
        if merged and all(prev == cur * size for prev, cur in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    if len(merged) > max_dims:
        return None
    merged = [(1, [0] * len(strides))] * (max_dims - len(merged)) + merged
    return [m[0] for m in merged], [[m[1][k] for m in merged] for k in range(len(strides))]


def store_pitches(packed: Tensor, norms: Tensor) -> tuple[int, int]:
    """(bytes between consecutive rows of ``packed``, floats between consecutive ``norms``) of outputs flattened over
    their leading dimensions (``packed [..., bytes]``, ``norms [...]``): the kernel writes flattened row r at
    ``packed + r * packed_pitch`` and ``norms + r * norm_pitch``.

    Contiguous outputs give (bytes, 1). Rows that hold their codes and norm side by side, ``packed = rows[..., :kb]``
    and ``norms = rows[..., kb:].view(torch.float32).squeeze(-1)`` of a uint8 ``rows [..., kb + 4]``, give
    (kb + 4, (kb + 4) / 4). Anything else raises a ValueError naming the tensor and its strides: leading strides that
    do not collapse to one uniform row stride, a ``packed`` row that is not contiguous, a ``packed`` pitch or address
    that is not a multiple of 4 bytes (the kernel stores 2- and 4-byte words), a misaligned ``norms``, or rows that
    overlap.
    """
    if packed.shape[-1] > 1 and packed.stride(-1) != 1:
        raise ValueError(f"`packed` must have contiguous rows (last stride 1), got shape {list(packed.shape)} and "
                         f"strides {packed.stride()}")
    rows = math.prod(norms.shape)
    return (_row_pitch("packed", packed, packed.dim() - 1, packed.shape[-1], rows),
            _row_pitch("norms", norms, norms.dim(), 1, rows))


def _row_pitch(name: str, t: Tensor, lead_dims: int, row: int, rows: int) -> int:
    """Elements between consecutive rows of ``t`` flattened over its first ``lead_dims`` dimensions (``rows`` rows of
    ``row`` elements), checked as :func:`store_pitches` says."""
    got = f"got shape {list(t.shape)} and strides {t.stride()}"
    pitch = row  # one row (or none): its pitch is never used
    if rows > 1:
        layout = collapse_rows(t.shape[:lead_dims], t.stride()[:lead_dims], max_dims=1)
        if layout is None:
            raise ValueError(f"`{name}` must have one uniform stride between consecutive rows over all its leading "
                             f"dimensions (the kernel writes flattened row r at r * pitch), {got}")
        pitch = layout[1][0][0]
    pitch_bytes = pitch * t.element_size()
    if pitch_bytes % 4 or t.data_ptr() % 4:
        raise ValueError(f"`{name}` rows must start at 4-byte aligned addresses (row pitch {pitch_bytes} bytes, "
                         f"address {t.data_ptr() % 4} mod 4), {got}")
    if rows > 1 and pitch < row:
        raise ValueError(f"`{name}` rows must not overlap (row pitch {pitch} < row length {row}), {got}")
    return pitch


def check_bits(bits: object) -> int:
    """``bits`` as an int in the codebook's supported set, else ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {bits!r}")
    return int(bits)


def aligned_rows(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``t`` itself when its data pointer and every leading stride (in bytes) are multiples of ``alignment``,
    else a fresh contiguous copy (which is 256-byte aligned)."""
    size = t.element_size()
    ok = t.data_ptr() % alignment == 0 and all(
        (stride * size) % alignment == 0 for stride, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1
    )
    if ok and t.stride(-1) == 1:
        return t
    return t.clone(memory_format=torch.contiguous_format)


SPLIT_CODES = (
    "split codes (`outlier_channels` / `key_qjl`): no fused kernel reads them, so their whole path runs on the "
    "reference and decoding is much slower than with the default code"
)


def unsupported(head_dim: int, bits: int, split_code: bool = False) -> str | None:
    """Why no compress kernel serves ``head_dim``-vectors at ``bits`` bits (a phrase), or None when one does.

    ``split_code``: the vectors are one part of a split code (:class:`~flashquant_hf.codec.HeadCodec`), which stays
    on the reference with the attention that reads it.
    """
    if split_code:
        return SPLIT_CODES
    if head_dim not in HEAD_DIMS or bits not in BITS:
        return f"head_dim={head_dim}, bits={bits} (kernels: head_dim {HEAD_DIMS}, bits {BITS})"
    return None


def check_served(op: str, head_dim: int, bits: int) -> None:
    """Raise a ValueError naming the reason when no ``op`` kernel serves ``head_dim`` x ``bits``."""
    reason = unsupported(head_dim, bits)
    if reason is not None:
        raise ValueError(
            f"no CUDA `{op}` kernel for {reason}; `flashquant_hf.ops.{op}` runs the PyTorch reference for it"
        )


def _check_compress_inputs(
    x: object,
    rotation: object,
    boundaries: object,
    bits: object,
    centroids: object,
    norm_correction: bool,
    hadamard_signs: object,
) -> int:
    check_tensor("x", x, dtypes=tuple(DTYPE_NAMES))
    assert isinstance(x, torch.Tensor)
    if x.dim() < 1:
        raise ValueError("`x` must have at least one dimension [..., head_dim], got a scalar")
    head_dim = x.shape[-1]
    bits = check_bits(bits)
    check_tensor("rotation", rotation, x.device, (torch.float32,), (head_dim, head_dim))
    check_tensor("boundaries", boundaries, x.device, (torch.float32,), ((1 << bits) - 1,))
    if norm_correction and centroids is None:
        raise ValueError("`centroids` are required when `norm_correction` is True")
    if centroids is not None:
        check_tensor("centroids", centroids, x.device, (torch.float32,), (1 << bits,))
    if hadamard_signs is not None:
        check_tensor("hadamard_signs", hadamard_signs, x.device, (torch.float32,), (head_dim,))
    if x.numel() // max(head_dim, 1) >= 2**31 - 2**20:
        raise ValueError(f"`x` has {x.numel() // head_dim} rows; the kernel takes fewer than 2^31 - 2^20")
    return bits


def compress(
    x: Tensor, rotation: Tensor, boundaries: Tensor, bits: int, centroids: Tensor | None = None,
    norm_correction: bool = False, hadamard_signs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Compress head vectors on the GPU: the contract of :func:`flashquant_hf.reference.compress.compress`, for
    these inputs.

    Parameters
    ----------
    x : fp16/bf16/fp32 CUDA tensor of shape [..., D]; any strides with a contiguous last dimension
    bits : 2, 3 or 4 (:func:`unsupported` for the others)
    hadamard_signs : the signs ``s`` of ``rotation = H diag(s) / sqrt(D)``: selects the fast Walsh-Hadamard path
    rotation, boundaries, centroids, norm_correction : as for the reference

    >>> packed, norms = compress(x, pi, boundaries, 4)  # doctest: +SKIP
    """
    bits = _check_compress_inputs(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs)
    head_dim = x.shape[-1]
    check_served("compress", head_dim, bits)

    lead = tuple(x.shape[:-1])
    packed = torch.empty(lead + (packed_size(head_dim, bits),), dtype=torch.uint8, device=x.device)
    norms = torch.empty(lead, dtype=torch.float32, device=x.device)
    rows = packed.numel() // packed.shape[-1]
    if rows == 0:
        return packed, norms
    launch_compress(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs, packed, norms)
    return packed, norms


def compress_into(
    x: Tensor, rotation: Tensor, boundaries: Tensor, bits: int, packed: Tensor, norms: Tensor, start: Tensor,
    centroids: Tensor | None = None, norm_correction: bool = False, hadamard_signs: Tensor | None = None,
) -> None:
    """Compress ``x`` into rows ``start .. start + n`` of a store on the GPU, in place, in one launch (see
    :func:`flashquant_hf.reference.compress.compress_into`): the kernel reads ``start`` from device memory (no host
    synchronisation; CUDA graphs replay it with the counter's value then) and writes nothing for a start outside
    ``[0, N - n]``.

    Parameters
    ----------
    x : shape [..., n, D], as for :func:`compress`
    packed : uint8 shape [..., N, ceil(D*bits/8)]; norms : fp32 shape [..., N]. Each may be a strided view whose
        rows [..., N] lie one uniform pitch apart (:func:`store_pitches`), e.g. codes and norm side by side in rows of
        one uint8 buffer.
    start : int64 CUDA tensor of one element, the first row

    >>> compress_into(x, pi, boundaries, 4, store_packed, store_norms, first_free)  # doctest: +SKIP
    """
    bits = _check_compress_inputs(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs)
    check_served("compress", x.shape[-1], bits)
    check_store_rows(x, packed, norms, start, bits)
    pitches = store_pitches(packed, norms)
    if x.numel() == 0:
        return
    launch_compress(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs, packed, norms, start,
                    pitches)


def launch_compress(
    x: torch.Tensor,
    rotation: torch.Tensor,
    boundaries: torch.Tensor,
    bits: int,
    centroids: torch.Tensor | None,
    norm_correction: bool,
    hadamard_signs: torch.Tensor | None,
    packed: torch.Tensor,
    norms: torch.Tensor,
    start: torch.Tensor | None = None,
    pitches: tuple[int, int] | None = None,
) -> None:
    """Launch the compress kernel (no validation) into ``packed``/``norms``: of ``x``'s leading shape, or, with
    ``start`` (int64, one element, on the device), stores ``[..., N, bytes]`` / ``[..., N]`` whose rows
    ``start .. start + n`` receive ``x [..., n, D]`` (a start outside ``[0, N - n]`` writes nothing). ``pitches``:
    :func:`store_pitches` of the outputs; None for contiguous ones (row bytes, 1)."""
    packed_pitch, norm_pitch = pitches if pitches is not None else (packed.shape[-1], 1)
    head_dim = x.shape[-1]
    x = aligned_rows(x, 16)
    layout = collapse_rows(x.shape[:-1], x.stride()[:-1])
    if layout is None:
        x = x.contiguous()
        layout = collapse_rows(x.shape[:-1], x.stride()[:-1])
    assert layout is not None
    sizes, (strides,) = layout
    rows = math.prod(x.shape[:-1])
    if start is None:  # one run of `rows` consecutive rows from row 0
        out_start, max_start, run, run_stride = np.uint64(0), 0, rows, rows
    else:  # runs of n rows (one per leading index), N slots apart, from row `start`
        slots = packed.shape[-2]
        out_start, max_start, run, run_stride = start, slots - x.shape[-2], x.shape[-2], slots
    device = x.device
    index = device_index(device)
    centroids_arg = centroids if centroids is not None else boundaries  # never read without norm correction
    if not rotation.is_contiguous() or rotation.data_ptr() % 16:  # the dense kernel reads Pi as float4
        rotation = rotation.clone(memory_format=torch.contiguous_format)
    threads = THREADS
    if hadamard_signs is not None:
        threads, rows_per_cta = hadamard_launch(head_dim, x.dtype)
        groups = -(-rows // rows_per_cta)
        grid = min(groups, sm_count(index) * _WAVES)
        name, table, smem = kernel_name("hadamard", head_dim, bits, x.dtype), hadamard_signs.contiguous(), 0
    else:
        tiles = -(-rows // _DENSE_ROWS[head_dim])
        grid = min(tiles, sm_count(index) * _DENSE_CTAS_PER_SM[head_dim] * 4)
        name, table, smem = kernel_name("dense", head_dim, bits, x.dtype), rotation, dense_smem_bytes(head_dim)
    kernel = loader.get_kernel(CUDA_SOURCE, name, device)
    args = (
        x, np.int64(strides[0]), np.int64(strides[1]), np.int64(strides[2]),
        *fast_divider(sizes[1]), *fast_divider(sizes[2]), rows,
        table, boundaries.contiguous(), centroids_arg.contiguous(), bool(norm_correction), packed, norms,
        out_start, np.int64(max_start), *fast_divider(run), np.int64(run_stride),
        np.int64(packed_pitch), np.int64(norm_pitch),
    )
    loader.launch(kernel, (grid,), (threads,), args, device, shared_mem=smem)
