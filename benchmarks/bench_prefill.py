"""Prefill attention: the FA2 kernel vs torch SDPA (bf16, causal), and the fused TQ4 kernel for a query chunk
over a long compressed prefix vs SDPA on the same shapes with exact (decompressed) K/V. Same run, same GPU.

FLOPs count only visible (query, key) pairs: 4 * D per pair (QK^T and PV), bottom-right causal.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from benchmarks.timing import copies_to_exceed_l2, time_ms
from flashquant_hf.codebook import lloyd_max_codebook
from flashquant_hf.kernels import flash_attention as fa
from flashquant_hf.kernels import loader
from flashquant_hf.kernels import tq_prefill as tqp
from flashquant_hf.reference.decompress import dequantize_rotated


def causal_pairs(q_len: int, kv_len: int) -> int:
    """Visible (query, key) pairs under the bottom-right causal mask."""
    return sum(min(kv_len, max(0, kv_len - q_len + i + 1)) for i in range(q_len))


def attention_tflops(batch: int, q_heads: int, head_dim: int, pairs: int, ms: float) -> float:
    return 4.0 * batch * q_heads * head_dim * pairs / (ms * 1e-3) / 1e12


def record_resources(record, prefix: str, source: str, name: str) -> None:
    """Registers per thread and local (spill) bytes of one compiled instantiation."""
    kernel = loader.get_kernel(source, name, torch.device("cuda"))
    record(f"{prefix}_regs", getattr(kernel, "num_regs", -1), "regs")
    record(f"{prefix}_local_bytes", getattr(kernel, "local_size_bytes", -1), "bytes")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_fa2(record) -> None:
    batch, heads, seq, head_dim = 4, 32, 4096, 128
    scale = head_dim ** -0.5
    pairs = causal_pairs(seq, seq)
    per_set = 3 * batch * heads * seq * head_dim * 2
    sets = [
        tuple(torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(copies_to_exceed_l2(per_set))
    ]
    sdpa_ms = time_ms([lambda s=s: F.scaled_dot_product_attention(*s, is_causal=True) for s in sets])
    sdpa_tflops = attention_tflops(batch, heads, head_dim, pairs, sdpa_ms)
    record("sdpa_prefill_ms", sdpa_ms, "ms")
    record("sdpa_prefill_tflops", sdpa_tflops, "TFLOP/s")

    ref = F.scaled_dot_product_attention(*sets[0], is_causal=True)
    default = fa.DEFAULT_CONFIGS[head_dim]
    configs = dict.fromkeys((default, *fa.CANDIDATE_CONFIGS.get(head_dim, ())))
    for config in configs:
        out, _ = fa.flash_attention_with(config, *sets[0], scale, True)
        record(f"fa2_prefill_rel_err_{config.label()}", relative_error(out, ref), "rel", "< 1e-2")
        ms = time_ms([lambda s=s: fa.flash_attention_with(config, *s, scale, True) for s in sets])
        tflops = attention_tflops(batch, heads, head_dim, pairs, ms)
        record(f"fa2_prefill_tflops_{config.label()}", tflops, "TFLOP/s")
        record_resources(record, f"fa2_{config.label()}", fa.CUDA_SOURCE,
                         fa.name_expression(head_dim, torch.bfloat16, config))
        if config == default:
            record("fa2_prefill_ms", ms, "ms")
            record("fa2_prefill_tflops", tflops, "TFLOP/s")
            record("fa2_prefill_vs_sdpa", tflops / sdpa_tflops, "ratio", ">= 0.50")
    del sets, ref


def _compressed_cache(batch, kv_heads, kv_len, head_dim, bits, capacity, gen):
    """Random TQ cache views ``[:, :, :N]`` of a larger capacity buffer, as TurboQuantCache hands them over."""
    nbytes = tqp.packed_bytes(head_dim, bits)
    packed = torch.randint(0, 256, (batch, kv_heads, capacity, nbytes), generator=gen, device="cuda",
                           dtype=torch.uint8)[:, :, :kv_len]
    norms = (0.5 + torch.rand(batch, kv_heads, capacity, generator=gen, device="cuda"))[:, :, :kv_len]
    return packed, norms * math.sqrt(head_dim) * 0.8


CHUNK_FA2_CONFIG = fa.TileConfig(8, 2, 64, False)  # the fused kernel's tiling, for the decode-free ceiling


def queued_ms(fns, reps: int = 50, lead_cycles: int = 2_000_000) -> float:
    """Device milliseconds of one call, launch overhead hidden behind a queued GPU sleep (diagnostic only)."""
    return time_ms(list(fns), reps=reps, lead_cycles=lead_cycles)


def bench_fused(record) -> None:
    batch, q_heads, kv_heads, head_dim, bits = 1, 32, 8, 128, 4
    q_len, prefix = 512, 32768
    kv_len = prefix + q_len  # the chunk's own keys are in the cache too (causal, bottom-right)
    scale = head_dim ** -0.5
    pairs = causal_pairs(q_len, kv_len)
    gen = torch.Generator(device="cuda").manual_seed(0)
    centroids = lloyd_max_codebook(head_dim, bits).tensors("cuda")[0]
    q_rot = torch.randn(batch, q_heads, q_len, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    per_set = 2 * batch * kv_heads * kv_len * (tqp.packed_bytes(head_dim, bits) + 4)
    caches = []
    for _ in range(copies_to_exceed_l2(per_set)):
        kp, kn = _compressed_cache(batch, kv_heads, kv_len, head_dim, bits, kv_len + 1024, gen)
        vp, vn = _compressed_cache(batch, kv_heads, kv_len, head_dim, bits, kv_len + 1024, gen)
        caches.append((kp, kn, vp, vn))

    # SDPA on the same shapes with exact bf16 K/V: the decompressed cache itself (rotated space, same answer).
    exact = []
    for kp, kn, vp, vn in caches[:2]:
        k = dequantize_rotated(kp, kn, centroids, bits, head_dim).to(torch.bfloat16)
        v = dequantize_rotated(vp, vn, centroids, bits, head_dim).to(torch.bfloat16)
        exact.append((k, v))
    baselines: dict[str, list] = {}  # name -> one closure per rotated input set
    try:  # flash path with native GQA; computes the full 512 x 512 corner (0.8% more work than counted)
        fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q_rot, k, v, enable_gqa=True) for k, v in exact]
        fns[0]()
        baselines["sdpa_gqa_full"] = fns
    except Exception as error:  # noqa: BLE001 - report it and keep the other baseline
        print(f"  sdpa with enable_gqa unavailable: {error}")
    try:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q_len, kv_len)
        group = q_heads // kv_heads
        expanded = [(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for k, v in exact]
        fns = [lambda k=k, v=v: F.scaled_dot_product_attention(q_rot, k, v, attn_mask=mask) for k, v in expanded]
        fns[0]()
        baselines["sdpa_causal_lower_right"] = fns
    except Exception as error:  # noqa: BLE001
        print(f"  sdpa with causal_lower_right unavailable: {error}")
    sdpa_ms = math.inf
    for name, fns in baselines.items():  # the fastest exact baseline is the one to beat
        ms = time_ms(fns)
        record(f"sdpa_chunk_ms_{name}", ms, "ms")
        sdpa_ms = min(sdpa_ms, ms)
    sdpa_tflops = attention_tflops(batch, q_heads, head_dim, pairs, sdpa_ms)
    record("sdpa_chunk_ms", sdpa_ms, "ms")
    record("sdpa_chunk_tflops", sdpa_tflops, "TFLOP/s")
    if "sdpa_gqa_full" in baselines:
        record("sdpa_chunk_queued_ms", queued_ms(baselines["sdpa_gqa_full"]), "ms")
    # Ceiling without decompression: our plain FA2 kernel on the same exact bf16 K/V, same tiling as the fused one.
    for config in dict.fromkeys((CHUNK_FA2_CONFIG, fa.DEFAULT_CONFIGS[head_dim])):
        ms = time_ms([lambda k=k, v=v: fa.flash_attention_with(config, q_rot, k, v, scale, True) for k, v in exact])
        record(f"fa2_chunk_tflops_{config.label()}", attention_tflops(batch, q_heads, head_dim, pairs, ms), "TFLOP/s")

    kp, kn, vp, vn = caches[0]
    ref = F.scaled_dot_product_attention(
        q_rot.float(), exact[0][0].float().repeat_interleave(q_heads // kv_heads, 1),
        exact[0][1].float().repeat_interleave(q_heads // kv_heads, 1),
        attn_mask=torch.ones(q_len, kv_len, device="cuda", dtype=torch.bool).tril(kv_len - q_len),
    )
    default = tqp.DEFAULT_CONFIGS[head_dim]
    configs = dict.fromkeys((default, *tqp.CANDIDATE_CONFIGS.get(head_dim, ())))
    for config in configs:
        splits = tqp.choose_splits(q_rot, kv_heads, kv_len, bits, bits, config)
        try:  # a variant that cannot launch here (e.g. a cluster too large to schedule) must not stop the others
            out, _ = tqp.tq_prefill_with(config, q_rot, kp, kn, vp, vn, centroids, centroids, bits, bits, scale,
                                         True)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001
            print(f"  {config.label()} failed: {error!r}")
            record(f"fused_prefill_failed_{config.label()}", 1, "error")
            continue
        record(f"fused_prefill_rel_err_{config.label()}", relative_error(out, ref), "rel", "< 1e-2")
        ms = time_ms([
            lambda c=c: tqp.tq_prefill_with(config, q_rot, *c, centroids, centroids, bits, bits, scale, True)
            for c in caches
        ])
        tflops = attention_tflops(batch, q_heads, head_dim, pairs, ms)
        record(f"fused_prefill_tflops_{config.label()}", tflops, "TFLOP/s")
        record(f"fused_prefill_queued_ms_{config.label()}", queued_ms([
            lambda c=c: tqp.tq_prefill_with(config, q_rot, *c, centroids, centroids, bits, bits, scale, True)
            for c in caches
        ]), "ms")
        record(f"fused_prefill_splits_{config.label()}", splits, "splits")
        record_resources(record, f"fused_{config.label()}", tqp.CUDA_SOURCE,
                         tqp.name_expression(head_dim, bits, bits, config))
        if config == default:
            default_launch = tqp.FAST_LAUNCH
            for fast, suffix in ((False, "_cupy_launch"), (default_launch, "")):  # the default last
                tqp.FAST_LAUNCH = fast
                torch.cuda.synchronize()
                begin = time.perf_counter()
                for c in caches * 4:  # not synchronised: the host time of the call alone
                    tqp.tq_prefill_with(config, q_rot, *c, centroids, centroids, bits, bits, scale, True)
                record(f"fused_prefill_host_us{suffix}", (time.perf_counter() - begin) / (4 * len(caches)) * 1e6,
                       "us")
                torch.cuda.synchronize()
            tqp.FAST_LAUNCH = default_launch
            record("fused_prefill_ms", ms, "ms")
            record("fused_prefill_tflops", tflops, "TFLOP/s")
            record("fused_prefill_vs_sdpa", tflops / sdpa_tflops, "ratio", ">= 0.40")


def precompile() -> None:
    """Compile every measured instantiation in parallel (NVRTC releases the GIL) before any timing."""
    device = torch.device("cuda", torch.cuda.current_device())
    jobs = [(fa.CUDA_SOURCE, fa.name_expression(128, torch.bfloat16, c))
            for c in dict.fromkeys((fa.DEFAULT_CONFIGS[128], *fa.CANDIDATE_CONFIGS[128]))]
    jobs += [(tqp.CUDA_SOURCE, tqp.name_expression(128, 4, 4, c))
             for c in dict.fromkeys((tqp.DEFAULT_CONFIGS[128], *tqp.CANDIDATE_CONFIGS[128]))]
    jobs += [(fa.CUDA_SOURCE, fa.name_expression(128, torch.bfloat16, CHUNK_FA2_CONFIG))]
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda job: loader.get_kernel(job[0], job[1], device), jobs))
    except Exception as error:  # noqa: BLE001 - each measurement compiles lazily and reports the real error
        print(f"  parallel precompile failed: {error!r}")


def run(record) -> None:
    """Entry point for benchmarks/run_gpu.py."""
    precompile()
    bench_fa2(record)
    torch.cuda.empty_cache()
    bench_fused(record)
