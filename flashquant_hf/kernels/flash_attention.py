"""CUDA FlashAttention-2 forward (``cuda/flash_attention.cu``) over uncompressed fp16/bf16 K/V.

Same signature and semantics as :func:`flashquant_hf.reference.flash_attention.flash_attention`. The tiling
(warps, 16-row tiles per warp, key tile, Q in registers or shared memory) is a template choice per head dim;
:data:`DEFAULT_CONFIGS` holds the ones used, :data:`CANDIDATE_CONFIGS` the ones the benchmark compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import checks, loader

CUDA_SOURCE = "flash_attention.cu"
HEAD_DIMS = (64, 128, 256)
DTYPES = {torch.float16: "fa::f16", torch.bfloat16: "fa::bf16"}
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class TileConfig:
    """Template tiling of the FA2 kernels: ``warps`` per CTA, ``m_tiles`` 16-row tiles per warp, ``block_n``
    keys per tile, and whether the Q fragments stay in registers (else re-read from shared memory per tile).
    Fused TurboQuant kernel only: ``overlap`` interleaves the next tile's decompression with the mmas;
    ``cluster`` >= 1 selects the sm_90 kernel whose thread-block clusters of that many row blocks decode each key
    tile once and share it through distributed shared memory (1: its pipeline without sharing); 0: the
    classic kernel."""

    warps: int
    m_tiles: int
    block_n: int
    q_in_registers: bool
    overlap: bool = False
    cluster: int = 0

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return 32 * self.warps

    @property
    def block_m(self) -> int:
        """Query rows per CTA."""
        return 16 * self.warps * self.m_tiles

    def template_args(self) -> str:
        """The four trailing template arguments, as C++."""
        return f"{self.warps}, {self.m_tiles}, {self.block_n}, {'true' if self.q_in_registers else 'false'}"

    def label(self) -> str:
        """Short name for benchmark records, e.g. ``w4m2n64s`` (s: Q in shared memory, r: in registers; suffix
        ``o``: overlap, ``c2``: cluster of 2)."""
        q_place = "r" if self.q_in_registers else "s"
        cluster = f"c{self.cluster}" if self.cluster else ""
        return f"w{self.warps}m{self.m_tiles}n{self.block_n}{q_place}{'o' if self.overlap else ''}{cluster}"


# Measured on the H200 (docs/kernels_prefill.md): at D = 128, causal B=4 H=32 N=4096, 4 warps x 2 row tiles x
# 64 keys reached 303 TFLOP/s, ahead of w4m1n64r 292, w4m2n32s 287, w8m2n64s 274, w8m1n64r 270.
DEFAULT_CONFIGS: dict[int, TileConfig] = {
    64: TileConfig(4, 2, 64, True),
    128: TileConfig(4, 2, 64, False),
    256: TileConfig(4, 1, 32, False),
}
CANDIDATE_CONFIGS: dict[int, tuple[TileConfig, ...]] = {
    128: (TileConfig(4, 2, 64, False), TileConfig(4, 2, 32, False), TileConfig(4, 1, 64, True)),
}


def name_expression(head_dim: int, dtype: torch.dtype, config: TileConfig) -> str:
    """C++ name of one instantiation of ``flash_attention_fwd`` (``overlap`` and ``cluster`` do not apply here)."""
    return f"flash_attention_fwd<{head_dim}, {DTYPES[dtype]}, {config.template_args()}>"


NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    dict.fromkeys(
        name_expression(d, t, c)
        for d in HEAD_DIMS
        for t in DTYPES
        for c in (DEFAULT_CONFIGS[d], *CANDIDATE_CONFIGS.get(d, ()))
    )
)


def shared_bytes(head_dim: int, config: TileConfig) -> int:
    """Dynamic shared memory of ``flash_attention_fwd`` (mirrors the layout comment of the kernel)."""
    stage = 2 * config.block_n * 2 * head_dim
    q_tile = config.block_m * 2 * head_dim
    return stage + max(q_tile, stage) if config.q_in_registers else 2 * stage + q_tile


def aligned_rows(t: torch.Tensor, align: int, itemsize: int) -> bool:
    """Whether every row of ``t`` (last dim contiguous) starts ``align``-byte aligned."""
    if t.stride(-1) != 1 or t.data_ptr() % align:
        return False
    return all((s * itemsize) % align == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def as_aligned(t: torch.Tensor, align: int = 16) -> torch.Tensor:
    """``t`` itself when its rows are ``align``-byte aligned with a contiguous last dim, else a compact copy."""
    if aligned_rows(t, align, t.element_size()):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
        checks.check_dtype(name, t, tuple(DTYPES), error=TypeError)
        checks.check_rank(name, t, ("B", "H", "L", "D"))
    checks.check_same_dtype({"q": q, "k": k, "v": v}, error=TypeError)
    checks.check_same_device({"q": q, "k": k, "v": v})
    batch, q_heads, _, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim} (`q` shape {list(q.shape)})")
    kv_heads, kv_len = k.shape[1], k.shape[2]
    for name, t in (("k", k), ("v", v)):
        checks.check_shape(name, t, (batch, kv_heads, kv_len, head_dim), ("B", "H_kv", "N", "D"))
    check_heads_grid_scale("q", batch, q_heads, kv_heads, scale)


def check_heads_grid_scale(query_name: str, batch: int, q_heads: int, kv_heads: int, scale: float) -> None:
    """The checks every FA2-family launch shares: GQA divisibility, the grid's y/z limit, a usable scale."""
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"`{query_name}` heads ({q_heads}) must be a multiple of the KV heads ({kv_heads})")
    if batch > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:
        raise ValueError(f"batch and KV heads must be <= {MAX_GRID_YZ}, got {batch} and {kv_heads}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"`scale` must be a finite positive number, got {scale!r}")


def launch_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    out: torch.Tensor, lse: torch.Tensor, config: TileConfig,
) -> None:
    """Run the kernel into preallocated contiguous ``out [B, Hq, Lq, D]`` (q's dtype) and ``lse [B, Hq, Lq]``
    fp32 (inputs already validated; misaligned views are copied)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if batch == 0 or q_heads == 0 or q_len == 0:
        return
    if kv_len == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return
    q, k, v = as_aligned(q), as_aligned(k), as_aligned(v)
    group = q_heads // kv_heads
    kernel = loader.get_kernel(CUDA_SOURCE, name_expression(head_dim, q.dtype, config), q.device)
    i64 = np.int64
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    args = (
        q, k, v, out, lse, q_heads, kv_heads, q_len, kv_len,
        i64(qs[0]), i64(qs[1]), i64(qs[2]),
        i64(ks[0]), i64(ks[1]), i64(ks[2]),
        i64(vs[0]), i64(vs[1]), i64(vs[2]),
        float(scale) * math.log2(math.e), bool(causal),
    )
    grid = (-(-q_len * group // config.block_m), kv_heads, batch)
    loader.launch(kernel, grid, (config.threads,), args, q.device, shared_mem=shared_bytes(head_dim, config))


def flash_attention_with(
    config: TileConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attention` with an explicit tiling (benchmarks and tests compare tilings)."""
    _check_inputs(q, k, v, scale)
    return _run(config, q, k, v, scale, causal)


def _run(config: TileConfig, q, k, v, scale, causal) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_heads, q_len, head_dim = q.shape
    out = torch.empty(batch, q_heads, q_len, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    launch_flash_attention(q, k, v, float(scale), bool(causal), out, lse, config)
    return out, lse


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward on tensor cores (CUDA), grouped-query heads, bottom-right causal mask.

    Parameters
    ----------
    q : fp16/bf16 shape [B, Hq, Lq, D], D in {64, 128, 256}; any strides (rows not 16-byte aligned are copied)
    k, v : same dtype, shape [B, H_kv, N, D] with Hq a multiple of H_kv (views of a larger cache are fine)
    scale : positive softmax scale applied to q.k
    causal : query i sees key j iff j <= N - Lq + i (rows that see nothing get out 0 and lse -inf)

    Returns
    -------
    out : shape [B, Hq, Lq, D] contiguous, q's dtype
    lse : fp32 shape [B, Hq, Lq], natural log-sum-exp of the scaled scores

    >>> q = torch.randn(1, 8, 100, 128, device="cuda", dtype=torch.bfloat16)
    >>> k = v = torch.randn(1, 2, 100, 128, device="cuda", dtype=torch.bfloat16)
    >>> out, lse = flash_attention(q, k, v, 128 ** -0.5, causal=True)
    """
    _check_inputs(q, k, v, scale)
    return _run(DEFAULT_CONFIGS[q.shape[-1]], q, k, v, scale, causal)
