"""CUDA ``tq_prefill``: ``tq_attention`` for query chunks (Lq >= 1) over the contiguous compressed layout.

FlashAttention-2 with the K/V tiles decompressed inside the tile loop (``cuda/tq_prefill.cu``): packed
bytes and norms go HBM -> shared memory, centroids are looked up into bf16 tiles there, and the tensor cores
take it from there; no full-precision K/V is written anywhere. Queries are converted to bf16 for the mma.
When the (row block x KV head x batch) grid cannot fill the GPU, the keys are split across CTAs and the
partial results merged by log-sum-exp with the decode path's merge kernel (``cuda/merge_partials.cu``, see
:mod:`flashquant_hf.kernels.merge_partials`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
from torch import Tensor

from . import checks, loader, merge_partials
from .flash_attention import MAX_GRID_YZ, TileConfig, aligned_rows, as_aligned, check_heads_grid_scale

CUDA_SOURCE = "tq_prefill.cu"
HEAD_DIMS = (64, 128, 256)
KERNEL_BITS = (2, 3, 4)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_TILES_PER_SPLIT = 4
SMEM_PER_SM = 228 * 1024  # H100/H200; the occupancy estimate only sizes the split count
SMEM_RESERVED_PER_CTA = 1024
REGS_PER_SM = 64 * 1024

# Measured on the H200 (docs/kernels_prefill.md): at D = 128, a 512-token chunk over a 32K TQ4 prefix, 8 warps x
# 2 row tiles (256 rows share each decompressed tile) in clusters of 2 CTAs that decode half of every key tile each
# and share it through distributed shared memory (w8m2n64soc2) reached 245 and 252 TFLOP/s in two runs, ahead of
# the same tiling without clusters (w8m2n64s, 228 and 249; the fallback below sm_90), w4m2n32s (214, 231) and
# w8m2n64so (214, 231). Clusters of 4 or 8 do not fit the GPU in one wave (half the speed).
DEFAULT_CONFIGS: dict[int, TileConfig] = {
    64: TileConfig(4, 2, 64, True),
    128: TileConfig(8, 2, 64, False, overlap=True, cluster=2),
    256: TileConfig(4, 1, 32, False),
}
# Below sm_90 (no thread-block clusters): the best measured tiling of the classic kernel.
FALLBACK_CONFIGS: dict[int, TileConfig] = {128: TileConfig(8, 2, 64, False)}
CANDIDATE_CONFIGS: dict[int, tuple[TileConfig, ...]] = {
    128: (
        TileConfig(8, 2, 64, False),
        TileConfig(8, 2, 64, False, overlap=True),
        TileConfig(8, 2, 64, False, cluster=2),
        TileConfig(8, 2, 64, False, overlap=True, cluster=2),
        TileConfig(4, 2, 32, False),
    ),
}
_DEFAULTS: dict[tuple[int, int], TileConfig] = {}  # (device index, head_dim) -> default_config


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed vector (see docs/ARCHITECTURE.md)."""
    return (head_dim * bits + 7) // 8


def part_bytes(head_dim: int, bits: int) -> int:
    """Bytes one thread fetches and decodes per work item (``Packed::PART`` in the kernel)."""
    total = packed_bytes(head_dim, bits)
    return total if bits == 3 else min(total, 16)


def name_expression(head_dim: int, k_bits: int, v_bits: int, config: TileConfig) -> str:
    """C++ name of one instantiation of ``tq_prefill_kernel`` (``tq_prefill_cluster_kernel`` when
    ``config.cluster`` >= 1)."""
    overlap = "true" if config.overlap else "false"
    if config.cluster:
        return (f"tq_prefill_cluster_kernel<{head_dim}, {k_bits}, {v_bits}, {config.template_args()}, {overlap}, "
                f"{config.cluster}>")
    return f"tq_prefill_kernel<{head_dim}, {k_bits}, {v_bits}, {config.template_args()}, {overlap}>"


def fallback_config(head_dim: int) -> TileConfig:
    """Tiling used for ``head_dim`` on GPUs without thread-block clusters (below sm_90)."""
    config = DEFAULT_CONFIGS[head_dim]
    return FALLBACK_CONFIGS.get(head_dim, dataclasses.replace(config, cluster=0))


NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    dict.fromkeys(
        [name_expression(d, kb, vb, c) for d in HEAD_DIMS for kb in KERNEL_BITS for vb in KERNEL_BITS
         for c in (DEFAULT_CONFIGS[d], fallback_config(d))]
        + [name_expression(d, 4, 4, c) for d, configs in CANDIDATE_CONFIGS.items() for c in configs]
    )
)


def default_config(head_dim: int, device: torch.device) -> TileConfig:
    """:data:`DEFAULT_CONFIGS` entry for ``head_dim``; :func:`fallback_config` on GPUs older than sm_90."""
    config = DEFAULT_CONFIGS[head_dim]
    if config.cluster and loader.device_capability(loader.device_index(device)) < loader.CLUSTER_MIN_CAPABILITY:
        return fallback_config(head_dim)
    return config


def grid_row_blocks(q_len: int, group: int, config: TileConfig) -> int:
    """Row blocks launched along grid x: enough for ``q_len * group`` rows, rounded up to whole clusters (the
    extra blocks own no rows; they only decode their share of the key tiles)."""
    blocks = -(-q_len * group // config.block_m)
    per_cluster = max(1, config.cluster)
    return -(-blocks // per_cluster) * per_cluster


def shared_bytes(head_dim: int, k_bits: int, v_bits: int, config: TileConfig) -> int:
    """Dynamic shared memory of ``tq_prefill_kernel`` (mirrors the layout comment of the kernel)."""
    bn = config.block_n
    stage = 2 * bn * 2 * head_dim + 3 * bn * 4
    q_tile = config.block_m * 2 * head_dim
    tables = 48 * 4
    if config.cluster:  # three stages; the raw buffer holds this CTA's slice of BN / cluster key rows
        rows = bn // config.cluster
        raw = rows * (packed_bytes(head_dim, k_bits) + packed_bytes(head_dim, v_bits)) + 3 * rows * 4
        return 3 * stage + -(-raw // 16) * 16 + tables + q_tile
    raw = bn * (packed_bytes(head_dim, k_bits) + packed_bytes(head_dim, v_bits)) + 3 * bn * 4
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


def _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                  key_bias) -> None:
    checks.check_tensor("q_rot", q_rot)
    checks.check_dtype("q_rot", q_rot, QUERY_DTYPES, error=TypeError)
    checks.check_rank("q_rot", q_rot, ("B", "Hq", "Lq", "D"))
    batch, q_heads, _, head_dim = q_rot.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim} (`q_rot` shape {list(q_rot.shape)})")
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if bits not in KERNEL_BITS:
            raise ValueError(f"`{name}` must be one of {KERNEL_BITS} for the CUDA kernel, got {bits!r}")
    # k_packed fixes H_kv and N for the others (a non-tensor here raises ValueError, as it always did).
    checks.check_layout("k_packed", k_packed, torch.uint8, (batch, "H_kv", "N", packed_bytes(head_dim, k_bits)))
    kv_heads, kv_len = int(k_packed.shape[1]), int(k_packed.shape[2])
    expected = {
        "k_packed": (k_packed, torch.uint8, (batch, kv_heads, kv_len, packed_bytes(head_dim, k_bits))),
        "v_packed": (v_packed, torch.uint8, (batch, kv_heads, kv_len, packed_bytes(head_dim, v_bits))),
        "k_norms": (k_norms, torch.float32, (batch, kv_heads, kv_len)),
        "v_norms": (v_norms, torch.float32, (batch, kv_heads, kv_len)),
        "k_centroids": (k_centroids, torch.float32, (1 << k_bits,)),
        "v_centroids": (v_centroids, torch.float32, (1 << v_bits,)),
    }
    if key_bias is not None:
        expected["key_bias"] = (key_bias, torch.float32, (batch, kv_len))
    for name, (t, dtype, shape) in expected.items():
        checks.check_is_tensor(name, t)
        checks.check_layout(name, t, dtype, shape)
        checks.check_device(name, t, q_rot.device, like="`q_rot`")
    check_heads_grid_scale("q_rot", batch, q_heads, kv_heads, scale)


# Launch through cached cuLaunchKernel parameter arrays (kernels.loader.launch_cached); False: CuPy's launch.
FAST_LAUNCH = True
NULL = np.uint64(0)
F32 = torch.float32


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything about one call that depends only on its signature (shapes, strides, alignments, settings)."""

    kernel: object
    kernel_ptr: int  # CUfunction for loader.launch_cached
    grid: tuple[int, int, int]
    threads: int
    smem: int
    scalars: tuple  # the kernel arguments after the ten pointers
    splits: int
    convert_q: bool  # queries need the bf16 (aligned) copy on every call
    index: int
    device: torch.device
    out_shape: tuple[int, ...]  # [B, Hq, Lq, D]
    merge: object  # the merge_partials kernel for splits > 1, else None
    merge_ptr: int
    merge_grid: tuple[int, int, int]
    rows: int  # B * Hq * Lq


_PLANS: dict[tuple, tuple[_Plan, bool]] = {}  # signature -> (plan, whether inputs of this signature were validated)
_MAX_PLANS = 512


def _signature(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale, causal,
               key_bias, config, splits) -> tuple:
    """Everything validation and planning depend on (raises AttributeError / TypeError for non-tensors)."""
    return (
        q_rot.dtype, q_rot.shape, q_rot.stride(), q_rot.get_device(), q_rot.data_ptr() & 15,
        k_packed.dtype, k_packed.shape, k_packed.stride(), k_packed.get_device(), k_packed.data_ptr() & 15,
        v_packed.dtype, v_packed.shape, v_packed.stride(), v_packed.get_device(), v_packed.data_ptr() & 15,
        k_norms.dtype, k_norms.shape, k_norms.stride(), k_norms.get_device(),
        v_norms.dtype, v_norms.shape, v_norms.stride(), v_norms.get_device(),
        k_centroids.dtype, k_centroids.shape, k_centroids.stride(), k_centroids.get_device(),
        v_centroids.dtype, v_centroids.shape, v_centroids.stride(), v_centroids.get_device(),
        None if key_bias is None else (key_bias.dtype, key_bias.shape, key_bias.stride(), key_bias.get_device()),
        k_bits, v_bits, scale.__class__, scale, causal, config, splits,
    )


def _make_plan(q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, scale, causal, key_bias, config,
               splits) -> tuple[_Plan | None, tuple]:
    """Plan of a validated call with ``kv_len > 0`` and a non-empty query; also returns the (possibly copied)
    ``(q, k_packed, v_packed)`` to launch with. The plan is ``None`` when a packed tensor had to be copied (the
    copy is per call, so its layout is not the caller's)."""
    batch, q_heads, q_len, head_dim = q_rot.shape
    kv_heads, kv_len = k_packed.shape[1], k_packed.shape[2]
    q = as_aligned(q_rot.to(torch.bfloat16))
    kp, k_vec = _packed_vector(k_packed, head_dim, k_bits)
    vp, v_vec = _packed_vector(v_packed, head_dim, v_bits)
    n_tiles = -(-kv_len // config.block_n)
    split_len = -(-n_tiles // splits) * config.block_n
    group = q_heads // kv_heads
    index = loader.device_index(q.device)
    device = torch.device("cuda", index)
    kernel = loader.get_kernel(CUDA_SOURCE, name_expression(head_dim, k_bits, v_bits, config), device)
    i64, i32 = np.int64, np.int32
    qs, kps, kns, vps, vns = q.stride(), kp.stride(), k_norms.stride(), vp.stride(), v_norms.stride()
    bias_strides = (i64(0), i64(0)) if key_bias is None else (i64(key_bias.stride(0)), i64(key_bias.stride(1)))
    scalars = (
        i32(batch), i32(q_heads), i32(kv_heads), i32(q_len), i32(kv_len), i32(split_len), i32(k_vec), i32(v_vec),
        i64(qs[0]), i64(qs[1]), i64(qs[2]),
        i64(kps[0]), i64(kps[1]), i64(kps[2]), i64(kns[0]), i64(kns[1]), i64(kns[2]),
        i64(vps[0]), i64(vps[1]), i64(vps[2]), i64(vns[0]), i64(vns[1]), i64(vns[2]),
        *bias_strides, np.float32(float(scale) * math.log2(math.e)), i32(bool(causal)),
    )
    rows = batch * q_heads * q_len
    merge, merge_ptr = merge_partials.merge_kernel(head_dim, index, splits) if splits > 1 else (None, 0)
    plan = _Plan(
        kernel, loader.function_ptr(kernel, index), (grid_row_blocks(q_len, group, config), kv_heads, batch * splits),
        config.threads, shared_bytes(head_dim, k_bits, v_bits, config), scalars, splits, q is not q_rot, index,
        device, (batch, q_heads, q_len, head_dim), merge, merge_ptr, merge_partials.merge_grid(rows), rows,
    )
    copied = kp is not k_packed or vp is not v_packed
    return (None if copied else plan), (plan, q, kp, vp)


def _execute(plan: _Plan, q, kp, vp, k_norms, v_norms, k_centroids, v_centroids, key_bias, out, lse) -> None:
    """Enqueue the kernel (into ``out``/``lse``: the partials when ``plan.splits`` > 1) on the current stream."""
    args = (q, kp, k_norms, vp, v_norms, k_centroids, v_centroids, NULL if key_bias is None else key_bias, out,
            lse) + plan.scalars
    loader.launch_cached(plan.kernel, plan.kernel_ptr, plan.grid, plan.threads, args, plan.index, plan.smem,
                         FAST_LAUNCH)


def _prepare(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale, causal,
             key_bias, config, splits, validate: bool):
    """(plan, q, k_packed, v_packed) to launch; plan ``None`` when there is no query or no key.

    A signature seen before skips planning and, if its inputs were validated then, validation (the signature
    holds everything the checks read); plans are stored only when no packed tensor had to be copied."""
    try:
        key = _signature(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                         causal, key_bias, config, splits)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: validation names the argument
        key = plan = None
    if plan is not None and (plan[1] or not validate):
        plan = plan[0]
        q = as_aligned(q_rot.to(torch.bfloat16)) if plan.convert_q else q_rot
        return plan, q, k_packed, v_packed
    if validate:
        _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                      key_bias)
    return _plan_uncached(key, validate, q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, scale, causal,
                          key_bias, config, splits)


def _plan_uncached(key, validated, q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, scale, causal,
                   key_bias, config, splits):
    dev = q_rot.device
    if config.cluster and loader.device_capability(loader.device_index(dev)) < loader.CLUSTER_MIN_CAPABILITY:
        raise ValueError(f"`config` {config.label()} uses a thread-block cluster, which needs sm_90 or newer; "
                         f"got a GPU of capability {loader.device_capability(loader.device_index(dev))}")
    batch, q_heads, q_len, head_dim = q_rot.shape
    kv_heads, kv_len = k_packed.shape[1], k_packed.shape[2]
    if splits is None:
        splits = choose_splits(q_rot, kv_heads, kv_len, k_bits, v_bits, config)
    if not (isinstance(splits, int) and 1 <= splits <= MAX_GRID_YZ // max(1, batch)):
        raise ValueError(f"`splits` must be an int in [1, {MAX_GRID_YZ // max(1, batch)}], got {splits!r}")
    if batch == 0 or q_heads == 0 or q_len == 0 or kv_len == 0:
        return None, q_rot, k_packed, v_packed
    cacheable, (plan, q, kp, vp) = _make_plan(q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits,
                                              float(scale), bool(causal), key_bias, config, splits)
    if cacheable is not None and key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = (cacheable, validated)
    return plan, q, kp, vp


def launch_tq_prefill(
    q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits: int, v_bits: int, scale: float,
    causal: bool, key_bias, out: torch.Tensor, lse: torch.Tensor, config: TileConfig, splits: int,
) -> None:
    """Run the kernel (inputs already validated) writing ``splits`` partial results into contiguous
    ``out [splits, B, Hq, Lq, D]`` and ``lse [splits, B, Hq, Lq]`` fp32 (``splits`` = 1: the final result).
    Keys are divided into ``splits`` ranges of whole tiles; empty ranges write out 0 and lse -inf."""
    prepared = _prepare(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                        causal, key_bias, config, splits, validate=False)
    if prepared[0] is None:  # nothing to attend or no query
        if k_packed.shape[2] == 0 and out.numel():
            out.zero_()
            lse.fill_(-math.inf)
        return
    plan, q, kp, vp = prepared
    _execute(plan, q, kp, vp, k_norms, v_norms, k_centroids, v_centroids, key_bias, out, lse)


def choose_splits(q_rot: torch.Tensor, kv_heads: int, kv_len: int, k_bits: int, v_bits: int, config: TileConfig) -> int:
    """Key splits for this launch: enough CTAs for one full wave on this GPU, never below 4 tiles per split."""
    batch, q_heads, q_len, head_dim = q_rot.shape
    return _splits(loader.device_index(q_rot.device), batch, q_heads, q_len, head_dim, kv_heads, kv_len, k_bits, v_bits,
                   config)


@functools.lru_cache(maxsize=4096)
def _splits(index: int, batch: int, q_heads: int, q_len: int, head_dim: int, kv_heads: int, kv_len: int, k_bits: int,
            v_bits: int, config: TileConfig) -> int:
    # Cached: a launch is timed from the caller's side, so the Python before it counts as latency.
    ctas = grid_row_blocks(q_len, q_heads // kv_heads, config) * kv_heads * batch
    if ctas == 0 or kv_len == 0:
        return 1
    device = torch.device("cuda", index)
    kernel = loader.get_kernel(CUDA_SOURCE, name_expression(head_dim, k_bits, v_bits, config), device)
    per_sm = ctas_per_sm(kernel, config.threads, shared_bytes(head_dim, k_bits, v_bits, config))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = plan_splits(ctas, -(-kv_len // config.block_n), sms * per_sm)
    return max(1, min(splits, MAX_GRID_YZ // max(1, batch)))


def tq_prefill_with(
    config: TileConfig, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None, splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tq_prefill` with an explicit tiling and (optionally) split count (benchmarks and tests)."""
    return _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                causal, key_bias, splits)


def _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale, causal,
         key_bias, splits) -> tuple[torch.Tensor, torch.Tensor]:
    prepared = _prepare(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                        causal, key_bias, config, splits, validate=True)
    plan = prepared[0]
    if plan is None:  # no query or no key: nothing to launch
        batch, q_heads, q_len, head_dim = q_rot.shape
        out = torch.zeros(batch, q_heads, q_len, head_dim, dtype=F32, device=q_rot.device)
        lse = torch.full((batch, q_heads, q_len), -math.inf, dtype=F32, device=q_rot.device)
        return out, lse
    _, q, kp, vp = prepared
    out = torch.empty(plan.out_shape, dtype=F32, device=plan.device)
    lse = torch.empty(plan.out_shape[:-1], dtype=F32, device=plan.device)
    if plan.splits == 1:
        _execute(plan, q, kp, vp, k_norms, v_norms, k_centroids, v_centroids, key_bias, out, lse)
        return out, lse
    # One buffer for both partials (one allocation); stream order keeps it alive for the merge.
    rows, head_dim = plan.rows, plan.out_shape[-1]
    parts = torch.empty(plan.splits * rows * (head_dim + 1), dtype=F32, device=plan.device)
    parts_ptr = parts.data_ptr()
    part_out, part_lse = np.uint64(parts_ptr), np.uint64(parts_ptr + 4 * plan.splits * rows * head_dim)
    _execute(plan, q, kp, vp, k_norms, v_norms, k_centroids, v_centroids, key_bias, part_out, part_lse)
    args = merge_partials.contiguous_merge_args(part_out, part_lse, out, lse, plan.splits, rows, head_dim)
    loader.launch_cached(plan.merge, plan.merge_ptr, plan.merge_grid, merge_partials.MERGE_THREADS, args, plan.index, 0,
                         FAST_LAUNCH)
    return out, lse


def tq_prefill(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, k_bits: int, v_bits: int, scale: float, causal: bool = False, key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused FlashAttention-2 over compressed K/V (CUDA): the contract of
    :func:`flashquant_hf.reference.tq_attention.tq_attention` for any ``Lq >= 1``, for these inputs.

    Parameters
    ----------
    q_rot : fp16/bf16/fp32 shape [B, Hq, Lq, D]; D in {64, 128, 256} (converted to bf16)
    k_packed, v_packed : views ``[:, :, :N]`` of a larger capacity buffer are read in place
    k_bits, v_bits : 2, 3 or 4
    scale : positive
    k_norms, v_norms, k_centroids, v_centroids, causal, key_bias : as for the reference

    >>> out_rot, lse = tq_prefill(q_rot, kp, kn, vp, vn, kc, vc, 4, 4, 128 ** -0.5, causal=True)
    """
    try:  # the default tiling of the first call's device and head_dim (a cached lookup)
        config = _DEFAULTS[(q_rot.get_device(), q_rot.shape[-1])]
    except (AttributeError, KeyError, IndexError, TypeError):
        _check_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                      key_bias)
        config = _DEFAULTS[(q_rot.get_device(), q_rot.shape[-1])] = default_config(q_rot.shape[-1], q_rot.device)
    return _run(config, q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                causal, key_bias, None)
