"""CUDA ``tq_prefill``: ``tq_attention`` for query chunks (Lq >= 1) over the contiguous compressed layout.

FlashAttention-2 with the K/V tiles decompressed inside the tile loop (``cuda/fused_tq_attention.cu``): packed
bytes and norms go HBM -> shared memory, centroids are looked up into bf16 tiles there, and the tensor cores
take it from there; no full-precision K/V is written anywhere. Queries are converted to bf16 for the mma.
When the (row block x KV head x batch) grid cannot fill the GPU, the keys are split across CTAs and the
partial results merged by log-sum-exp (:func:`flashquant_hf.reference.split_k.merge_partials`: a handful of
small torch ops on the partials, negligible beside the attention).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..reference.split_k import merge_partials
from . import loader
from .flash_attention import MAX_GRID_YZ, TileConfig, aligned_rows, as_aligned, check_heads_grid_scale

CUDA_SOURCE = "fused_tq_attention.cu"
HEAD_DIMS = (64, 128, 256)
KERNEL_BITS = (2, 3, 4)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_TILES_PER_SPLIT = 4
SMEM_PER_SM = 228 * 1024  # H100/H200; the occupancy estimate only sizes the split count
SMEM_RESERVED_PER_CTA = 1024
REGS_PER_SM = 64 * 1024

# Measured on the H200 (docs/kernels_prefill.md): at D = 128, a 512-token chunk over a 32K TQ4 prefix, 8 warps x
# 2 row tiles (256 rows share each decompressed tile) reached 222 TFLOP/s, ahead of w8m1n64r 207, w4m2n32s 202,
# w4m2n64s 195, w4m1n64r 175. The `overlap` variants (decompression between the mma phases) are not measured yet.
DEFAULT_CONFIGS: dict[int, TileConfig] = {
    64: TileConfig(4, 2, 64, True),
    128: TileConfig(8, 2, 64, False),
    256: TileConfig(4, 1, 32, False),
}
CANDIDATE_CONFIGS: dict[int, tuple[TileConfig, ...]] = {
    128: (
        TileConfig(8, 2, 64, False),
        TileConfig(4, 2, 64, False),
        TileConfig(8, 1, 64, True),
        TileConfig(8, 2, 64, False, overlap=True),
        TileConfig(8, 1, 64, True, overlap=True),
    ),
}


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed vector (see docs/ARCHITECTURE.md)."""
    return (head_dim * bits + 7) // 8


def part_bytes(head_dim: int, bits: int) -> int:
    """Bytes one thread fetches and decodes per work item (``Packed::PART`` in the kernel)."""
    total = packed_bytes(head_dim, bits)
    return total if bits == 3 else min(total, 16)


def name_expression(head_dim: int, k_bits: int, v_bits: int, config: TileConfig) -> str:
    """C++ name of one instantiation of ``fused_tq_attention_fwd``."""
    overlap = "true" if config.overlap else "false"
    return f"fused_tq_attention_fwd<{head_dim}, {k_bits}, {v_bits}, {config.template_args()}, {overlap}>"


NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [name_expression(d, kb, vb, DEFAULT_CONFIGS[d]) for d in HEAD_DIMS for kb in KERNEL_BITS for vb in KERNEL_BITS]
        + [name_expression(d, 4, 4, c) for d, configs in CANDIDATE_CONFIGS.items() for c in configs]
    )
)


def shared_bytes(head_dim: int, k_bits: int, v_bits: int, config: TileConfig) -> int:
    """Dynamic shared memory of ``fused_tq_attention_fwd`` (mirrors the layout comment of the kernel)."""
    bn = config.block_n
    stage = 2 * bn * 2 * head_dim + 3 * bn * 4
    q_tile = config.block_m * 2 * head_dim
    raw = bn * (packed_bytes(head_dim, k_bits) + packed_bytes(head_dim, v_bits)) + 3 * bn * 4
    tables = 48 * 4
    if config.q_in_registers:
        return stage + max(stage, q_tile) + raw + tables
    return 2 * stage + raw + tables + q_tile


def ctas_per_sm(kernel, threads: int, smem: int) -> int:
    """Resident CTAs per SM estimated from the kernel's registers and shared memory."""
    regs = int(getattr(kernel, "num_regs", 0) or 255)
    warps = threads // 32
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


def plan_splits(ctas: int, n_tiles: int, capacity: int) -> int:
    """Key splits so that ``ctas * splits`` fills at most one wave of ``capacity`` resident CTAs, each split
    keeping at least ``MIN_TILES_PER_SPLIT`` key tiles."""
    if ctas >= capacity or n_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(1, min(capacity // ctas, n_tiles // MIN_TILES_PER_SPLIT, MAX_GRID_YZ))


def _packed_vector(t: torch.Tensor, head_dim: int, bits: int) -> tuple[torch.Tensor, int]:
    """(tensor, cp.async width in bytes): the widest of 16/8/4 that divides the fetch unit and aligns every row;
    a view that admits none is copied compactly."""
    part = part_bytes(head_dim, bits)
    for vec in (16, 8, 4):
        if part % vec == 0 and aligned_rows(t, vec, 1):
            return t, vec
    t = t.clone(memory_format=torch.contiguous_format)
    return t, next(vec for vec in (16, 8, 4) if part % vec == 0)


def _check_tensor(name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"`{name}` must be {dtype} of shape {list(shape)}, got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"`{name}` must be on {device}, got {t.device}")


def _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                  key_bias) -> None:
    if not isinstance(q_rot, torch.Tensor):
        raise TypeError(f"`q_rot` must be a torch.Tensor, got {type(q_rot).__name__}")
    if not q_rot.is_cuda:
        raise ValueError(f"`q_rot` must be on a CUDA device, got {q_rot.device}")
    if q_rot.dtype not in QUERY_DTYPES:
        raise TypeError(f"`q_rot` must be one of {QUERY_DTYPES}, got {q_rot.dtype}")
    if q_rot.dim() != 4:
        raise ValueError(f"`q_rot` must have shape [B, Hq, Lq, D], got {list(q_rot.shape)}")
    batch, q_heads, _, head_dim = q_rot.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim} (`q_rot` shape {list(q_rot.shape)})")
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if bits not in KERNEL_BITS:
            raise ValueError(f"`{name}` must be one of {KERNEL_BITS} for the CUDA kernel, got {bits!r}")
    if not isinstance(k_packed, torch.Tensor) or k_packed.dim() != 4:
        raise ValueError(f"`k_packed` must be uint8 of shape [B, H_kv, N, {packed_bytes(head_dim, k_bits)}], got "
                         f"{getattr(k_packed, 'shape', type(k_packed).__name__)}")
    kv_heads, kv_len = int(k_packed.shape[1]), int(k_packed.shape[2])
    dev = q_rot.device
    _check_tensor("k_packed", k_packed, (batch, kv_heads, kv_len, packed_bytes(head_dim, k_bits)), torch.uint8, dev)
    _check_tensor("v_packed", v_packed, (batch, kv_heads, kv_len, packed_bytes(head_dim, v_bits)), torch.uint8, dev)
    _check_tensor("k_norms", k_norms, (batch, kv_heads, kv_len), torch.float32, dev)
    _check_tensor("v_norms", v_norms, (batch, kv_heads, kv_len), torch.float32, dev)
    _check_tensor("k_centroids", k_centroids, (1 << k_bits,), torch.float32, dev)
    _check_tensor("v_centroids", v_centroids, (1 << v_bits,), torch.float32, dev)
    if key_bias is not None:
        _check_tensor("key_bias", key_bias, (batch, kv_len), torch.float32, dev)
    check_heads_grid_scale("q_rot", batch, q_heads, kv_heads, scale)


def launch_tq_prefill(
    q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits: int, v_bits: int, scale: float,
    causal: bool, key_bias, out: torch.Tensor, lse: torch.Tensor, config: TileConfig, splits: int,
) -> None:
    """Run the kernel (inputs already validated) writing ``splits`` partial results into contiguous
    ``out [splits, B, Hq, Lq, D]`` and ``lse [splits, B, Hq, Lq]`` fp32 (``splits`` = 1: the final result).
    Keys are divided into ``splits`` ranges of whole tiles; empty ranges write out 0 and lse -inf."""
    batch, q_heads, q_len, head_dim = q_rot.shape
    kv_heads, kv_len = k_packed.shape[1], k_packed.shape[2]
    if batch == 0 or q_heads == 0 or q_len == 0:
        return
    if kv_len == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return
    q = as_aligned(q_rot.to(torch.bfloat16))
    k_packed, k_vec = _packed_vector(k_packed, head_dim, k_bits)
    v_packed, v_vec = _packed_vector(v_packed, head_dim, v_bits)
    n_tiles = -(-kv_len // config.block_n)
    split_len = -(-n_tiles // splits) * config.block_n
    group = q_heads // kv_heads
    kernel = loader.get_kernel(CUDA_SOURCE, name_expression(head_dim, k_bits, v_bits, config), q.device)
    i64 = np.int64
    qs, kps, kns, vps, vns = q.stride(), k_packed.stride(), k_norms.stride(), v_packed.stride(), v_norms.stride()
    bias_args = (np.uint64(0), i64(0), i64(0)) if key_bias is None else (
        key_bias, i64(key_bias.stride(0)), i64(key_bias.stride(1)))
    args = (
        q, k_packed, k_norms, v_packed, v_norms,
        k_centroids.contiguous(), v_centroids.contiguous(), bias_args[0], out, lse,
        batch, q_heads, kv_heads, q_len, kv_len, split_len, k_vec, v_vec,
        i64(qs[0]), i64(qs[1]), i64(qs[2]),
        i64(kps[0]), i64(kps[1]), i64(kps[2]), i64(kns[0]), i64(kns[1]), i64(kns[2]),
        i64(vps[0]), i64(vps[1]), i64(vps[2]), i64(vns[0]), i64(vns[1]), i64(vns[2]),
        bias_args[1], bias_args[2], float(scale) * math.log2(math.e), bool(causal),
    )
    grid = (-(-q_len * group // config.block_m), kv_heads, batch * splits)
    loader.launch(kernel, grid, (config.threads,), args, q.device,
                  shared_mem=shared_bytes(head_dim, k_bits, v_bits, config))


def choose_splits(q_rot: torch.Tensor, kv_heads: int, kv_len: int, k_bits: int, v_bits: int, config: TileConfig) -> int:
    """Key splits for this launch: enough CTAs for one full wave on this GPU, never below 4 tiles per split."""
    batch, q_heads, q_len, head_dim = q_rot.shape
    ctas = -(-q_len * (q_heads // kv_heads) // config.block_m) * kv_heads * batch
    if ctas == 0 or kv_len == 0:
        return 1
    kernel = loader.get_kernel(CUDA_SOURCE, name_expression(head_dim, k_bits, v_bits, config), q_rot.device)
    per_sm = ctas_per_sm(kernel, config.threads, shared_bytes(head_dim, k_bits, v_bits, config))
    sms = torch.cuda.get_device_properties(q_rot.device).multi_processor_count
    splits = plan_splits(ctas, -(-kv_len // config.block_n), sms * per_sm)
    return max(1, min(splits, MAX_GRID_YZ // max(1, batch)))


def tq_prefill_with(
    config: TileConfig, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None, splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tq_prefill` with an explicit tiling and (optionally) split count (benchmarks and tests)."""
    _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                  key_bias)
    return _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                causal, key_bias, splits)


def _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale, causal,
         key_bias, splits) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_heads, q_len, head_dim = q_rot.shape
    kv_heads, kv_len = k_packed.shape[1], k_packed.shape[2]
    if splits is None:
        splits = choose_splits(q_rot, kv_heads, kv_len, k_bits, v_bits, config)
    if not (isinstance(splits, int) and 1 <= splits <= MAX_GRID_YZ // max(1, batch)):
        raise ValueError(f"`splits` must be an int in [1, {MAX_GRID_YZ // max(1, batch)}], got {splits!r}")
    dev = q_rot.device
    out = torch.empty(splits, batch, q_heads, q_len, head_dim, dtype=torch.float32, device=dev)
    lse = torch.empty(splits, batch, q_heads, q_len, dtype=torch.float32, device=dev)
    launch_tq_prefill(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits,
                      float(scale), bool(causal), key_bias, out, lse, config, splits)
    if splits == 1:
        return out[0], lse[0]
    return merge_partials(out, lse)


def tq_prefill(
    q_rot: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    k_bits: int,
    v_bits: int,
    scale: float,
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused FlashAttention-2 over compressed K/V (CUDA); the ``tq_attention`` contract for any ``Lq >= 1``.

    Parameters
    ----------
    q_rot : fp16/bf16/fp32 shape [B, Hq, Lq, D], already ``q @ Pi_K.T``; D in {64, 128, 256} (converted to bf16)
    k_packed, v_packed : uint8 shape [B, H_kv, N, ceil(D*bits/8)] (views ``[:, :, :N]`` of a larger capacity
        buffer are read in place)
    k_norms, v_norms : fp32 shape [B, H_kv, N]
    k_centroids, v_centroids : fp32 shape [2^bits]; k_bits, v_bits in {2, 3, 4}
    scale : positive softmax scale applied to q.k
    causal : bottom-right aligned (query i sees key j iff j <= N - Lq + i)
    key_bias : optional fp32 shape [B, N] added to every score of key j (0 or -inf for padding)

    Returns
    -------
    out_rot : fp32 shape [B, Hq, Lq, D] in value-rotated space (multiply by ``Pi_V`` to leave it)
    lse : fp32 shape [B, Hq, Lq], natural log-sum-exp of the scaled scores (-inf, and out 0, where no key is visible)

    >>> out_rot, lse = tq_prefill(q_rot, kp, kn, vp, vn, kc, vc, 4, 4, 128 ** -0.5, causal=True)
    """
    _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                  key_bias)
    config = DEFAULT_CONFIGS[q_rot.shape[-1]]
    return _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                causal, key_bias, None)
