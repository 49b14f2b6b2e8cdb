"""Planning and launching of the split-K decode (``cuda/tq_decode.cu``, splits merged by ``cuda/merge_partials.cu``).

The machinery under the two decode wrappers, ``tq_decode.py`` (contiguous layout) and ``paged_decode.py`` (paged
store): the build a launch compiles, the split plan (from the SM count, the batch and the length), the cached
partial-result workspace and the launch. Both layouts run the same kernel template; only the address computation
differs (template ``MODE``).

Host-side plan, once per (shape, length bucket) and reused by every layer of a decode step: the key range of
each (sequence, KV head) is cut into ``splits`` equal pieces of ``split_len`` keys (a multiple of ``GRANULE``,
the keys of one round of all warps of a CTA), chosen to fill ``SMs x CTAs-per-SM`` slots in whole waves; with one
split the kernel writes the result directly, otherwise ``merge_partials.cu`` merges the partials.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..paged import BLOCK_SIZES
from ..store_layout import NORM_BYTES, contiguous_staging_pays, inline_norms, norms_follow_rows
from . import checks, decode_launcher, loader, merge_partials
from .loader import get_kernel

CUDA_SOURCE = "tq_decode.cu"
HEAD_DIMS = (64, 128, 256)
BITS = (1, 2, 3, 4)  # key and value code widths, each independently
QUERY_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
MODE_CONTIGUOUS, MODE_CONTIGUOUS_BIAS, MODE_PAGED = 0, 1, 2
# Warps per CTA for head_dim <= 128 (template W; head_dim 256 always runs 4): 8, two CTAs x 8 warps per SM sharing
# one pair of tables per CTA (benchmarks/bench_decode.py sweeps WARP_CHOICES).
WARPS = 8
WARP_CHOICES = (4, 8)


def warps_for(head_dim: int, warps: int | None = None) -> int:
    """Warps per CTA of the instantiation used for ``head_dim`` (``warps`` overrides the tuned default)."""
    return 4 if head_dim == 256 else (WARPS if warps is None else warps)


def kernel_name(head_dim: int, query_kind: int, mode: int, k_bits: int = 4, v_bits: int = 4,
                warps: int | None = None) -> str:
    """Name expression of one decode instantiation."""
    return (f"fqd::tq_decode_kernel<{head_dim}, {query_kind}, {mode}, {warps_for(head_dim, warps)}, {k_bits}, "
            f"{v_bits}>")


def table_entries(bits: int) -> int:
    """Entries of the code -> centroid-pair table of ``bits``-bit codes (``Code::kEntries`` in decode_codes.cuh)."""
    return 16 if bits == 1 else 256


def lut_bytes(k_bits: int = 4, v_bits: int = 4) -> int:
    """Shared memory of the two tables (entries at a 256-byte stride, K and V interleaved) + kLutSlack."""
    return 256 * max(table_entries(k_bits), table_entries(v_bits)) + 1024


def token_bytes(head_dim: int, k_bits: int = 4, v_bits: int = 4) -> int:
    """Bytes of one token of one KV head: packed key and value codes and their fp32 norms."""
    return head_dim * (k_bits + v_bits) // 8 + 8




def reduction_bytes(head_dim: int, warps: int) -> int:
    """Shared memory of the cross-warp reduction that reuses the tables' space at the end of a split."""
    return 4 * warps * 8 * (head_dim + 2)


HEADS_PER_CTA = 8  # the n = 8 head slots of one mma tile
# GQA <= 4 runs the build whose mma columns are (head, half of the contraction / output dims) pairs, 4 head slots per
# CTA (every lane scores a served head; half the O^T accumulator registers).
PAIRED_OPTION = "-DFQD_HEAD_SLOTS=4"
# Staged tiles on sm_90 (8 warps): every tile reaches shared memory by the copy engine, two tiles ahead per warp,
# instead of ten register loads per lane (plus an L2 prefetch when paged): paged blocks of 16 keys (one bulk copy per
# tile), and the contiguous layout without key_bias where rows are packed and each (sequence, head) run is 16-byte
# aligned (one copy per run: two to four per tile, see contiguous_runs). False gives the register loads of other
# GPUs (tests compare both on sm_90).
TMA_TILES = True
TMA_OPTION = "-DFQD_TMA_TILES=1"
# How a contiguous launch stages its tiles (runs_staged, see staged_runs): not at all, codes and norms as separate runs,
# or the sides store_layout.inline_norms picks as one run of rows with their norms (the build's option).
RUNS_SEPARATE, RUNS_INLINE = 1, 2
INLINE_NORMS_OPTION = "-DFQD_INLINE_NORMS=1"
TMA_PREFETCH_CHUNKS = 0  # L2 prefetch distance beyond the two staged tiles (none: faster without on the H200)
LUT_BYTES = 2 * 256 * 32 * 4 + 1024  # the TQ4 tables: K and V byte->pair tables, one copy per lane, + kLutSlack
MAX_PAGE_BYTES = 4096  # shared-memory copy of one split's block-table slice
GRANULE = 128  # keys per round of all warps of a CTA (Traits<D, W>::kChunk * W for every instantiation)
# L2 prefetch distances, tuned on the H200 by benchmarks/bench_decode.py (sweep over the three benchmark shapes):
PREFETCH_CHUNKS = 1  # paged: L2 prefetch distance, in warp iterations beyond the register prefetch (0: off)
CONTIGUOUS_PREFETCH_CHUNKS = 0  # the same for tq_decode (its split key/value loads gain nothing from it)
SLOT_FACTOR = 1.0  # planned CTA slots = SMs x resident CTAs x SLOT_FACTOR
# How much faster an SM's first resident CTA runs than its second (the schedulers favour older warps): when a plan's
# CTAs fill between one and two per SM, the splits the first places take (the kernel numbers CTAs split-major) get
# this much longer key ranges than the others, so both places finish together. 1.0: equal splits. H200: 1.17 for the
# paired build, 1.09 for the 8-slot build.
FIRST_PLACE_SPEEDUP = 1.17
FIRST_PLACE_SPEEDUP_8_SLOTS = 1.09
OVERHEAD_KEYS = 128  # per-CTA start/merge cost, in keys of streaming
PARTIAL_KEYS = 64  # cost of writing + merging one partial result, in keys
# Launch through cached cuLaunchKernel parameter arrays (kernels.loader.launch_cached) instead of CuPy's per-argument
# conversion, which costs about as much host time as the rest of a call. False: CuPy's launch (tests compare both).
FAST_LAUNCH = True
# Programmatic dependent launch (sm_90): the decode and merge kernels launch while their predecessor in the stream
# finishes and wait for it (griddepcontrol.wait) before touching memory, so launch latency overlaps its tail.
PROGRAMMATIC_LAUNCH = True
NULL = np.uint64(0)
LOG2E = 1.4426950408889634


def head_slots(group: int) -> int:
    """Query heads one CTA serves for a GQA group of ``group`` heads (4: the paired build, for groups up to 4)."""
    return 4 if group <= 4 else HEADS_PER_CTA


def block_size_option(log2_block_size: int) -> str:
    """NVRTC option of the paged build for blocks of ``2**log2_block_size`` keys (paged launches are built per block
    size, so the page arithmetic uses constant shifts)."""
    return f"-DFQD_PAGED_LOG2_BS={log2_block_size}"


def build_options(mode: int, heads: int, log2_block_size: int | None, head_dim: int,
                  capability_major: int, runs_staged: int = 0) -> tuple[str, ...]:
    """NVRTC options of the decode build a launch uses on a GPU of compute capability ``capability_major``.x: the
    paired build for 4 head slots (``heads``), the paged build for its block size, and staged tiles where they apply
    (see TMA_TILES; ``runs_staged``: how a contiguous layout's runs allow it, :func:`staged_runs`)."""
    options = (PAIRED_OPTION,) if heads == 4 else ()
    if mode == MODE_PAGED:
        options += (block_size_option(log2_block_size),)
    # sm_90 only: the stages need up to 105 KB of shared memory per CTA at D = 128, more than some later parts allow
    staged = log2_block_size == 4 if mode == MODE_PAGED else mode == MODE_CONTIGUOUS and runs_staged
    if TMA_TILES and staged and warps_for(head_dim) == 8 and capability_major == 9:
        options += (TMA_OPTION,)
        if mode == MODE_CONTIGUOUS and runs_staged == RUNS_INLINE:
            options += (INLINE_NORMS_OPTION,)
    return options




def contiguous_runs(k_packed: torch.Tensor, k_norms: torch.Tensor, v_packed: torch.Tensor,
                    v_norms: torch.Tensor) -> tuple[bool, bool] | None:
    """How the contiguous layout's sides can be bulk-copied per 16-key tile: per side (keys, values), True where the
    norms follow their code rows in one buffer (:mod:`~flashquant_hf.store_layout`: one run), False where codes and
    norms are two packed runs; None when a side is neither, or a (sequence, head) run does not start 16-byte
    aligned."""
    layout = []
    for codes, norms in ((k_packed, k_norms), (v_packed, v_norms)):
        row, pitch = codes.shape[3], codes.stride(2)
        if pitch == row and norms.stride(2) == 1:
            runs = ((codes, 1), (norms, 4))
            layout.append(False)
        elif (pitch == row + NORM_BYTES and norms.stride(2) * 4 == pitch
              and all(n == 1 or 4 * ns == cs for ns, cs, n in zip(norms.stride()[:2], codes.stride()[:2], codes.shape))
              and norms_follow_rows(codes, norms)):
            runs = ((codes, 1),)
            layout.append(True)
        else:
            return None
        for t, size in runs:
            if t.data_ptr() % 16 or any(s * size % 16 for s, n in zip(t.stride()[:2], t.shape[:2]) if n > 1):
                return None
    return layout[0], layout[1]


def staged_runs(head_dim: int, k_bits: int, v_bits: int, layout: tuple[bool, bool] | None) -> int:
    """``runs_staged`` of a contiguous launch without key_bias: RUNS_SEPARATE or RUNS_INLINE where the decode stages
    tiles at these widths (:func:`contiguous_staging_pays`) and the sides are laid out as that build reads them
    (:func:`contiguous_runs`; inline exactly where :func:`~flashquant_hf.store_layout.inline_norms` says), else 0
    (register loads)."""
    if layout is None or not contiguous_staging_pays(head_dim, k_bits, v_bits):
        return 0
    if layout == (False, False):
        return RUNS_SEPARATE
    return RUNS_INLINE if layout == inline_norms(head_dim, k_bits, v_bits) else 0


def _builds() -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Every (NVRTC options, name expressions) build a launch may compile, on any GPU."""
    builds: dict[tuple[str, ...], list[str]] = {}
    for capability_major in (8, 9):
        for heads in (HEADS_PER_CTA, 4):
            for mode in (MODE_CONTIGUOUS, MODE_CONTIGUOUS_BIAS, MODE_PAGED):
                sizes = [size.bit_length() - 1 for size in BLOCK_SIZES] if mode == MODE_PAGED else [None]
                for log2_block_size in sizes:
                    for head_dim in HEAD_DIMS:
                        for runs_staged in (0, RUNS_SEPARATE, RUNS_INLINE):
                            options = build_options(mode, heads, log2_block_size, head_dim, capability_major,
                                                    runs_staged)
                            names = builds.setdefault(options, [])
                            for kind in QUERY_KINDS.values():
                                name = kernel_name(head_dim, kind, mode)
                                if name not in names:
                                    names.append(name)
    return tuple((options, tuple(names)) for options, names in builds.items())


def _width_builds() -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """Builds of the other code widths: every (key, value) width pair at head_dim 128, and the pairs the cache
    presets use (3/3, 3/2, 2/2, 1/1) at head_dim 64 and 256, in the contiguous 8-slot build and the paged builds for
    blocks of 16 (paired with staged tiles, and the 8-slot register-load build). The width only changes the code
    of decode_codes.cuh, which these cover for every head_dim."""
    pairs = [(k, v) for k in BITS for v in BITS if (k, v) != (4, 4)]
    presets = [(3, 3), (3, 2), (2, 2), (1, 1)]

    def names(mode: int, dims: tuple[int, ...]) -> tuple[str, ...]:
        chosen = [(128, k, v) for k, v in pairs] + [(d, k, v) for d in dims if d != 128 for k, v in presets]
        return tuple(kernel_name(d, QUERY_KINDS[torch.bfloat16], mode, k, v) for d, k, v in chosen if d in dims)

    staged = (PAIRED_OPTION, block_size_option(4), TMA_OPTION)
    return (((), names(MODE_CONTIGUOUS, HEAD_DIMS)),
            ((block_size_option(4),), names(MODE_PAGED, HEAD_DIMS)),
            (staged, names(MODE_PAGED, (64, 128))),
            ((PAIRED_OPTION, TMA_OPTION), names(MODE_CONTIGUOUS, (64, 128))),
            ((PAIRED_OPTION, TMA_OPTION, INLINE_NORMS_OPTION), names(MODE_CONTIGUOUS, (64, 128))))


def _merged(*groups: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]):
    builds: dict[tuple[str, ...], list[str]] = {}
    for group in groups:
        for options, names in group:
            builds.setdefault(options, []).extend(n for n in names if n not in builds[options])
    return tuple((options, tuple(names)) for options, names in builds.items())


# Compiled by tests/test_cuda_compile.py: the paged builds per block size, the paired / staged-tile builds, and the
# other code widths.
BUILDS = _merged(_builds(), _width_builds())


def staged_tile_bytes(options: tuple[str, ...], head_dim: int, warps: int, k_bits: int = 4, v_bits: int = 4) -> int:
    """Shared memory of the bulk-copied tile stages (two 16-key tiles and their barriers per warp) in builds with
    ``-DFQD_TMA_TILES=1`` (8-warp kernels), else 0."""
    if TMA_OPTION not in options or warps != 8:
        return 0
    return warps * 2 * (16 * token_bytes(head_dim, k_bits, v_bits) + 8)


def units_shape(batch: int, kv_heads: int, group: int) -> tuple[int, int, int]:
    """(batch, H_kv, head groups): the grid's units for a group of ``group`` query heads per KV head."""
    return batch, kv_heads, -(-group // head_slots(group))


@dataclass(frozen=True)
class DecodePlan:
    """How one decode call is cut: ``splits`` key ranges per unit, the first ``long_splits`` of ``split_len`` keys
    and the others of ``short_len`` (by default all of ``split_len``); ``shared_mem`` bytes per CTA."""

    splits: int
    split_len: int
    shared_mem: int
    slots: int
    long_splits: int | None = None  # None: all splits are split_len long
    short_len: int | None = None

    @property
    def kernel_lengths(self) -> tuple[int, int, int]:
        """(split_len, long_splits, short_len) as the kernel takes them."""
        if self.long_splits is None:
            return self.split_len, self.splits, self.split_len
        return self.split_len, self.long_splits, self.short_len


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _prepared_kernel(name: str, device_index: int, options: tuple[str, ...] = ()) -> tuple[Any, int]:
    """The kernel with its shared-memory limits raised, and how many of its CTAs fit on one SM."""
    device = torch.device("cuda", device_index)
    head_dim, _, _, warps, k_bits, v_bits = (int(x) for x in name.split("<")[1].rstrip(">").split(","))
    threads = 32 * warps
    kernel = get_kernel(CUDA_SOURCE, name, device, options)
    smem = max(lut_bytes(k_bits, v_bits) + MAX_PAGE_BYTES + 16
               + staged_tile_bytes(options, head_dim, warps, k_bits, v_bits), reduction_bytes(head_dim, warps))
    kernel.max_dynamic_shared_size_bytes = smem
    try:
        kernel.preferred_shared_memory_carveout = 100  # 2-3 CTAs x ~69 KB (staged tiles: 2 x ~103 KB) need it all
    except Exception:  # an older CuPy without the attribute: the driver picks
        pass
    try:  # what the driver will actually co-schedule (registers, shared memory, carveout)
        import cupy

        with cupy.cuda.Device(device_index):
            resident = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, smem)
        return kernel, max(1, int(resident))
    except Exception:
        pass
    try:
        regs = -(-int(kernel.num_regs) // 8) * 8
        by_regs = 65536 // (regs * threads)
    except Exception:
        by_regs = 2
    props = torch.cuda.get_device_properties(device_index)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = per_sm // (smem + 1024)  # + the 1 KB the driver reserves per CTA
    return kernel, max(1, min(by_regs, by_smem))


@functools.lru_cache(maxsize=1024)
def plan_decode(units: int, max_len: int, head_dim: int, slots: int, log2_block_size: int | None = None,
                tables: int = LUT_BYTES) -> DecodePlan:
    """Split plan for ``units`` (sequence, KV head, head group) triples of up to ``max_len`` keys.

    Picks the split count minimising ``waves * (split_len + OVERHEAD_KEYS)`` plus the partials' cost, where a
    wave is ``slots`` (SMs x CTAs per SM) CTAs. Paged splits also keep their block-table slice within
    ``MAX_PAGE_BYTES``. ``max_len`` should be rounded to the granule by callers so one plan serves many steps.
    ``tables``: shared memory of the code tables (:func:`lut_bytes`), which the block-table slice follows.
    """
    gran = GRANULE
    length = max(gran, -(-max_len // gran) * gran)
    max_pages = MAX_PAGE_BYTES // 4 - 1
    best: tuple[float, int, int] | None = None
    limit = min(length // gran, 4 * slots // max(1, units) + 1)
    for s in range(1, max(1, limit) + 1):
        split_len = -(-(-(-length // s)) // gran) * gran
        if log2_block_size is not None and (split_len >> log2_block_size) + 1 > max_pages:
            continue
        used = -(-length // split_len)
        waves = -(-units * used // slots)
        cost = waves * (split_len + OVERHEAD_KEYS) + (used * units * PARTIAL_KEYS / slots if used > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, used, split_len)
    if best is None:  # very long sequences with tiny blocks: as many splits as the page budget needs
        split_len = (max_pages - 1) << log2_block_size
        best = (0.0, -(-length // split_len), split_len)
    _, splits, split_len = best
    pages = 0 if log2_block_size is None else 4 * ((split_len >> log2_block_size) + 1)
    return DecodePlan(splits, split_len, tables + pages, slots)


def balance_places(plan: DecodePlan, units: int, length: int, sms: int, ctas_per_sm: int,
                   log2_block_size: int | None = None, speedup: float | None = None) -> DecodePlan:
    """``plan`` with longer first splits for the CTAs that start first on their SM, ``speedup`` (default
    ``FIRST_PLACE_SPEEDUP``) times longer than the others: applies to plans of 2+ splits whose CTAs fill more than
    one and at most two places per SM of 2-CTA SMs, numbered split-major as the kernel does."""
    speedup = FIRST_PLACE_SPEEDUP if speedup is None else speedup
    ctas = units * plan.splits
    long_splits = sms // units
    if speedup == 1.0 or ctas_per_sm != 2 or not sms < ctas <= 2 * sms or not 0 < long_splits < plan.splits:
        return plan
    short_splits = plan.splits - long_splits
    gran = GRANULE
    long_len = round(length * speedup / (long_splits * speedup + short_splits) / gran) * gran
    short_len = -(-(length - long_splits * long_len) // (short_splits * gran)) * gran
    if short_len <= 0 or long_len <= short_len:
        return plan
    pages = 0
    if log2_block_size is not None:
        pages = 4 * ((long_len >> log2_block_size) + 1)
        if pages > MAX_PAGE_BYTES - 4:
            return plan
        pages -= 4 * ((plan.split_len >> log2_block_size) + 1)  # the plan's shared memory holds its own slice
    return DecodePlan(plan.splits, long_len, plan.shared_mem + pages, plan.slots, long_splits, short_len)


@functools.lru_cache(maxsize=32)
def _workspace(device_index: int, splits: int, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Reused by every layer of a step: the merge that reads it is stream-ordered before the next decode writes.
    device = torch.device("cuda", device_index)
    return (
        torch.empty(splits, rows, head_dim, dtype=torch.float32, device=device),
        torch.empty(splits, rows, dtype=torch.float32, device=device),
    )


@dataclass(frozen=True)
class _Launch:
    """Everything about one decode call that depends only on its shape: kernels, grid, plan."""

    kernel: Any
    merge: Any
    kernel_ptr: int  # CUfunction handles (RawKernel.kernel.ptr) for the fast launch path
    merge_ptr: int
    grid: tuple[int, int, int]
    threads: int
    plan: DecodePlan
    prefetch: int  # the kernel's L2 prefetch distance (chunks)
    options: tuple[str, ...]  # the NVRTC options of the kernel's build


_LAUNCHES: dict[tuple, _Launch] = {}
_CACHE_LIMIT = 256


def clear_caches() -> None:
    """Forget cached plans, workspaces and argument blocks (after changing the tuning constants)."""
    _LAUNCHES.clear()
    _PREPARED.clear()
    decode_launcher.clear()
    loader.clear_arg_blocks()
    plan_decode.cache_clear()
    _workspace.cache_clear()


def _launch_for(mode: int, head_dim: int, query_kind: int, bits: tuple[int, int], index: int,
                units: tuple[int, int, int], rows: int, length: int, log2_block_size: int | None,
                heads: int, runs_staged: int = 0) -> _Launch:
    key = (mode, head_dim, query_kind, bits, index, units, rows, length, log2_block_size, heads, runs_staged, WARPS,
           SLOT_FACTOR,
           FIRST_PLACE_SPEEDUP, FIRST_PLACE_SPEEDUP_8_SLOTS, TMA_TILES, PREFETCH_CHUNKS, TMA_PREFETCH_CHUNKS,
           CONTIGUOUS_PREFETCH_CHUNKS)
    found = _LAUNCHES.get(key)
    if found is not None:
        return found
    batch, kv_heads, head_groups = units
    warps = warps_for(head_dim)
    options = build_options(mode, heads, log2_block_size, head_dim, loader.device_capability(index)[0], runs_staged)
    kernel, ctas_per_sm = _prepared_kernel(kernel_name(head_dim, query_kind, mode, *bits, warps), index, options)
    slots = max(1, int(_sm_count(index) * ctas_per_sm * SLOT_FACTOR))
    plan = plan_decode(batch * kv_heads * head_groups, length, head_dim, slots, log2_block_size, lut_bytes(*bits))
    plan = balance_places(plan, batch * kv_heads * head_groups, length, _sm_count(index), ctas_per_sm,
                          log2_block_size, FIRST_PLACE_SPEEDUP if heads == 4 else FIRST_PLACE_SPEEDUP_8_SLOTS)
    shared_mem = max(plan.shared_mem + staged_tile_bytes(options, head_dim, warps, *bits),
                     reduction_bytes(head_dim, warps))
    plan = dataclasses.replace(plan, shared_mem=shared_mem)
    grid = (plan.splits, kv_heads * head_groups, batch)
    merge, merge_ptr = None, 0
    if plan.splits > 1:
        merge, merge_ptr = merge_partials.merge_kernel(head_dim, index, plan.splits)
    if TMA_OPTION in options:
        prefetch = TMA_PREFETCH_CHUNKS
    else:
        prefetch = PREFETCH_CHUNKS if mode == MODE_PAGED else CONTIGUOUS_PREFETCH_CHUNKS
    found = _Launch(kernel, merge, loader.function_ptr(kernel, index), merge_ptr, grid, 32 * warps, plan, prefetch,
                    options)
    if len(_LAUNCHES) >= _CACHE_LIMIT:
        _LAUNCHES.clear()
    _LAUNCHES[key] = found
    return found


def launch_cached(kernel, function: int, grid: tuple[int, int, int], block: int, args: tuple, device_index: int,
                  shared_mem: int = 0) -> None:
    """:func:`flashquant_hf.kernels.loader.launch_cached` with this module's ``FAST_LAUNCH`` and
    ``PROGRAMMATIC_LAUNCH`` settings."""
    # Inside a CUDA-graph capture the launches are ordinary ones: the captured graph orders its kernels itself.
    programmatic = PROGRAMMATIC_LAUNCH and not torch.cuda.is_current_stream_capturing()
    loader.launch_cached(kernel, function, grid, block, args, device_index, shared_mem, FAST_LAUNCH, programmatic)


def _decode_args(setup: _Launch, q3: torch.Tensor, q_strides: tuple[int, int, int], tensor_args: tuple, group: int,
                 centroids: tuple[torch.Tensor, torch.Tensor], scale: float, part_out, part_lse, rows: int) -> tuple:
    """The kernel's arguments in order (tensors where it reads or writes memory)."""
    i64 = np.int64
    return (
        q3, i64(q_strides[0]), i64(q_strides[1]), i64(q_strides[2]), *tensor_args,
        centroids[0], centroids[1], np.float32(scale * LOG2E), q3.shape[1], group, *setup.plan.kernel_lengths,
        part_out, part_lse, rows, setup.prefetch,
    )


def run_decode(
    mode: int, q3: torch.Tensor, q_strides: tuple[int, int, int], tensor_args: tuple, batch: int, kv_heads: int,
    group: int, max_len: int, centroids: tuple[torch.Tensor, torch.Tensor], bits: tuple[int, int], scale: float,
    out: torch.Tensor, lse: torch.Tensor, log2_block_size: int | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None, runs_staged: int = 0,
) -> PreparedDecode | None:
    """Plan, launch the decode kernel and (for several splits) the merge into ``out``, ``lse`` (contiguous,
    ``rows x D`` and ``rows`` elements).

    ``extra``: one more partial result ``(out [rows, D], lse [rows])`` fp32 that joins the merge as a last split
    (the exact part of a layer); the partials then live in a workspace allocated by torch for this call (graph-safe:
    under a CUDA-graph capture it comes from the graph's pool), and the merge always runs.

    ``tensor_args``: the 25 layout arguments of the kernel between the query strides and ``k_cent`` (pointers as
    tensors or ``NULL``, strides as ``np.int64``, ints as int). The grid's units are ``units_shape(batch, H_kv,
    group)``.
    The plan, workspace and argument layout are cached per shape, so repeated calls (every layer of every decode
    step) only rewrite pointers and launch. ``runs_staged``: how the contiguous layout's runs are bulk-copied
    (:func:`staged_runs`; 0: not at all).

    Returns, without ``extra`` and with ``FAST_LAUNCH``, the call prepared for reuse (:class:`PreparedDecode`):
    calls whose arguments differ only in their pointers may launch through it.
    """
    index = q3.device.index
    if index is None:
        index = torch.cuda.current_device()
    head_dim = q3.shape[-1]
    rows = lse.numel()
    length = -(-max_len // GRANULE) * GRANULE
    setup = _launch_for(mode, head_dim, QUERY_KINDS[q3.dtype], bits, index, units_shape(batch, kv_heads, group),
                        rows, length, log2_block_size, head_slots(group), runs_staged)
    plan = setup.plan
    merge, merge_ptr, merged_splits = setup.merge, setup.merge_ptr, plan.splits
    if extra is not None:
        merged_splits = plan.splits + 1
        part_out = torch.empty(merged_splits, rows, head_dim, dtype=torch.float32, device=q3.device)
        part_lse = torch.empty(merged_splits, rows, dtype=torch.float32, device=q3.device)
        part_out[plan.splits].copy_(extra[0].reshape(rows, head_dim))
        part_lse[plan.splits].copy_(extra[1].reshape(rows))
        merge, merge_ptr = merge_partials.merge_kernel(head_dim, index, merged_splits)
    elif plan.splits == 1:  # written directly
        part_out, part_lse = out, lse
    else:
        # Allocated here, not with the plan: a compiled step (which always passes ``extra``) must not create it
        # inside a CUDA-graph pool that outlives the step.
        part_out, part_lse = _workspace(index, plan.splits, rows, head_dim)
    args = _decode_args(setup, q3, q_strides, tensor_args, group, centroids, scale, part_out, part_lse, rows)
    merge_args = None
    if merge is not None:
        merge_args = merge_partials.contiguous_merge_args(part_out, part_lse, out, lse, merged_splits, rows, head_dim)
    if extra is None and FAST_LAUNCH and torch.cuda.current_device() == index:
        prepared = PreparedDecode.build(setup, args, merge_args, index, (part_out, part_lse) if merge else None)
        prepared(tuple(a.data_ptr() for a in args[:-4] if isinstance(a, torch.Tensor)), out.data_ptr(),
                 lse.data_ptr())
        return prepared
    launch_cached(setup.kernel, setup.kernel_ptr, setup.grid, setup.threads, args, index, plan.shared_mem)
    if merge is not None:
        launch_cached(merge, merge_ptr, merge_partials.merge_grid(rows), merge_partials.MERGE_THREADS, merge_args,
                      index)
    return None


@dataclass(frozen=True)
class PreparedDecode:
    """A decode call prepared for reuse: the decode launch and, for several splits, the merge launch, with every
    argument but the pointers written once (:class:`~flashquant_hf.kernels.loader.PreparedLaunch`). A call passes
    the addresses of the inputs (the tensors of the decode's arguments before the partial outputs, in order) and
    of ``out`` and ``lse``."""

    decode: loader.PreparedLaunch
    merge: loader.PreparedLaunch | None
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # the partials the merge reads (kept alive here)
    partials: tuple[int, int] | None  # their addresses
    options: tuple[str, ...]  # the decode build's NVRTC options

    @classmethod
    def build(cls, setup: _Launch, args: tuple, merge_args: tuple | None, index: int,
              workspace: tuple[torch.Tensor, torch.Tensor] | None) -> "PreparedDecode":
        decode = loader.PreparedLaunch(setup.kernel, setup.kernel_ptr, setup.grid, setup.threads, args, index,
                                       setup.plan.shared_mem)
        merge = None
        if merge_args is not None:
            rows = merge_args[-2]
            merge = loader.PreparedLaunch(setup.merge, setup.merge_ptr, merge_partials.merge_grid(rows),
                                          merge_partials.MERGE_THREADS, merge_args, index)
        partials = None if workspace is None else (workspace[0].data_ptr(), workspace[1].data_ptr())
        return cls(decode, merge, workspace, partials, setup.options)

    def __call__(self, inputs: tuple[int, ...], out: int, lse: int) -> None:
        # Inside a CUDA-graph capture the launches are ordinary ones: the captured graph orders its kernels itself.
        programmatic = PROGRAMMATIC_LAUNCH and not torch.cuda.is_current_stream_capturing()
        decode, merge = self.decode, self.merge
        stream = loader.raw_stream(decode.device_index)
        with decode.block_args.lock:  # the merge's parameter array is this call's too
            if merge is None:
                decode.write((*inputs, out, lse))
                decode.launch(stream, programmatic)
                return
            part_out, part_lse = self.partials
            decode.write((*inputs, part_out, part_lse))
            decode.launch(stream, programmatic)
            merge.write((part_out, part_lse, out, lse))
            merge.launch(stream, programmatic)


@dataclass
class PreparedCall:
    """A wrapper's prepared decode (:class:`PreparedDecode`) with what a reuse must still check per call: the byte
    alignment of the addresses its build assumed (shapes, strides, dtypes and devices are in the signature it is
    stored under; torch's current device must be the launch's). ``compiled``: registered with the compiled launcher
    (:mod:`~flashquant_hf.kernels.decode_launcher`)."""

    launch: PreparedDecode
    alignment: tuple[int, ...]  # per tensor of the call, in the order of the decode's pointer arguments (bytes)
    compiled: bool = False

    def aligned_pointers(self, tensors: tuple) -> tuple[int, ...] | None:
        """The addresses of ``tensors`` (in the order of :attr:`alignment`; None ones left out) for the launch, or
        None when one lacks the alignment the build assumed (the wrapper then checks and prepares the call)."""
        pointers = []
        for t, alignment in zip(tensors, self.alignment, strict=True):
            if t is not None:
                address = t.data_ptr()
                if address % alignment:
                    return None
                pointers.append(address)
        return tuple(pointers)


_PREPARED: dict[tuple, PreparedCall] = {}


def decode_outputs(q_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode's outputs for queries ``q_rot`` (``[B, Hq, 1, D]`` contiguous layout, ``[S, Hq, D]`` paged): fp32
    ``out`` of the queries' shape and ``lse`` without their last dim, contiguous (row per (sequence, head), as the
    kernels write them)."""
    out = torch.empty(q_rot.shape, dtype=torch.float32, device=q_rot.device)
    lse = torch.empty(q_rot.shape[:-1], dtype=torch.float32, device=q_rot.device)
    return out, lse


def compiled_launcher() -> Any:
    """The compiled launcher of prepared calls where it serves (built, and ``FAST_LAUNCH``), else None."""
    return decode_launcher.module() if FAST_LAUNCH else None


def run_compiled(tensors: tuple, values: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The call registered with the compiled launcher under ``tensors`` and ``values`` (see
    :func:`remember_compiled`), launched: (out, lse), or None when it does not serve this call (the wrapper then
    checks and launches it itself)."""
    launcher = compiled_launcher()
    if launcher is None:
        return None
    try:
        return launcher.run(tensors, values)
    except (TypeError, ValueError, RuntimeError):  # arguments it cannot read: the wrapper's checks name them
        return None


def remember_compiled(found: PreparedCall | None, tensors: tuple, values: tuple, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """Register a prepared call with the compiled launcher (starting its build the first time): ``tensors`` in the
    order of the decode's pointer arguments (None where absent, as ``found.alignment`` lists them), ``values`` the
    other arguments led by the wrapper's tag; ``out`` / ``lse`` give the output shapes."""
    if found is None or found.compiled or not FAST_LAUNCH:
        return
    programmatic = PROGRAMMATIC_LAUNCH and found.launch.decode.programmatic_config is not None
    found.compiled = decode_launcher.remember(tensors, values, found.launch, found.alignment, tuple(out.shape),
                                              tuple(lse.shape), programmatic)


def call_signature(wrapper: str, tensors: tuple, *values: Any) -> tuple | None:
    """What a decode call's validity and plan depend on besides its pointers: each tensor's shape, strides, dtype
    and device (None stays None) and the other arguments with their types (``True`` is not ``1``). None when an
    argument is not a tensor: the wrapper's full checks then name it."""
    try:
        # get_device(): the device as an int (-1 off CUDA), cheaper than building a torch.device
        metadata = tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors])
    except (AttributeError, TypeError):
        return None
    return (wrapper, metadata, values, tuple(map(type, values)))


def prepared_call(signature: tuple | None) -> PreparedCall | None:
    """The call prepared under ``signature``, if it is usable now (torch's current device is its device)."""
    found = _PREPARED.get(signature) if signature is not None and FAST_LAUNCH else None
    if found is not None and torch.cuda.current_device() == found.launch.decode.device_index:
        return found
    return None


def run_prepared(signature: tuple | None, tensors: tuple, values: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The call prepared under ``signature`` launched on ``tensors`` (the queries first, then in the order of the
    decode's pointer arguments) and registered with the compiled launcher: (out, lse), or None when there is none or
    an address lacks the alignment its build assumed (the wrapper then checks and prepares the call)."""
    prepared = prepared_call(signature)
    pointers = None if prepared is None else prepared.aligned_pointers(tensors)
    if pointers is None:
        return None
    out, lse = decode_outputs(tensors[0])
    prepared.launch(pointers, out.data_ptr(), lse.data_ptr())
    remember_compiled(prepared, tensors, values, out, lse)
    return out, lse


def remember_call(signature: tuple | None, launch: PreparedDecode | None,
                  alignment: tuple[int, ...]) -> PreparedCall | None:
    """Keep a checked call's prepared launch for later calls of the same signature (returned)."""
    if signature is None or launch is None:
        return None
    if len(_PREPARED) >= _CACHE_LIMIT:
        _PREPARED.clear()
    found = _PREPARED[signature] = PreparedCall(launch, alignment)
    return found


def check_query(q_rot: torch.Tensor, rank: int, layout: str) -> None:
    """Common checks of the rotated queries (CUDA, dtype, rank, head_dim)."""
    checks.check_tensor("q_rot", q_rot, dtypes=tuple(QUERY_KINDS))
    if q_rot.dim() != rank:
        raise ValueError(f"`q_rot` must have shape {layout}, got {list(q_rot.shape)}")
    if q_rot.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"`q_rot` head_dim must be one of {HEAD_DIMS} for the CUDA decode, got {q_rot.shape[-1]}")


def check_codebooks(k_centroids: torch.Tensor, v_centroids: torch.Tensor, k_bits: int, v_bits: int,
                    device: torch.device) -> None:
    """Code widths in BITS; fp32 [2^bits] contiguous centroids on the queries' device."""
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if bits not in BITS or isinstance(bits, bool):
            raise ValueError(f"`{name}` must be one of {BITS} for the CUDA decode, got {bits!r}")
    for name, c, bits in (("k_centroids", k_centroids, k_bits), ("v_centroids", v_centroids, v_bits)):
        checks.check_layout(name, c, torch.float32, (1 << bits,))
        if not c.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous, got strides {c.stride()}")
        checks.check_device(name, c, device, like="`q_rot`")
