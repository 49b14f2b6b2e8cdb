"""End-to-end decode with TurboQuantCache vs DynamicCache on a Llama-3-8B-shaped random model (bf16, GPU).

    python benchmarks/run_gpu.py --only e2e --skip-tests

Every cache (DynamicCache, TurboQuantCache(), bits=3, bits=2.5) is prefilled with the same random 32K-token prompts
(B=8; one forward with ``logits_to_keep=1``, in chunks if one forward does not fit); all stay resident, and then each
is timed over decode steps (the loop ``generate`` runs: one forward of one token per sequence, greedy next token),
the caches taking turns pass after pass. Records:

- ``e2e_decode_tokens_per_s_ratio_32k``: TurboQuantCache tokens/s over DynamicCache tokens/s (target >= 1.0), the
  median over ``PASSES`` interleaved passes, with its spread (``*_spread``: (max - min) / median);
- ``e2e_decode_tokens_per_s_ratio_bits3_vs_bits4`` / ``..._bits2p5_vs_bits4``: the ``bits=3`` / ``bits=2.5`` presets
  over the default TQ4 cache (target >= 1.0);
- ``max_context_ratio``: how much longer a context fits one KV memory budget, from ``cache.nbytes`` per token
  measured at 32K (DynamicCache bytes / TurboQuantCache bytes; target >= 3.5);
- ``decode_peak_extra_mem_fraction_32k``: the largest rise of allocated memory during one decode step over
  the bf16 K/V size of that context (target < 0.05), for both caches;
- the absolute tokens/s and bytes/token, and which backend ran (1 = CUDA kernels, 0 = PyTorch reference).

Each case is guarded: an out-of-memory error is recorded (``*_oom``) and the next case still runs. The whole
benchmark stops starting new work after ``TIME_BUDGET_S``.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
import traceback
from typing import Callable

import torch

from benchmarks.timing import relative_spread

BATCH = 8
CONTEXT = 32 * 1024
DECODE_STEPS = 16
WARMUP_STEPS = 2
PASSES = 3  # interleaved decode passes per cache
PREFILL_CHUNKS = (None, 8192, 2048)  # one forward first; smaller chunks only after an out-of-memory error
TIME_BUDGET_S = 240.0
LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
)


def build_model(layers: int = LLAMA3_8B["num_hidden_layers"]):
    """The random Llama-3-8B-shaped model with ``layers`` decoder layers, built directly on the GPU in bf16 (sdpa
    attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def _cache_kwargs(model, cache) -> dict:
    from flashquant_hf.cache import cache_kwargs

    return {**cache_kwargs(model, cache), "use_cache": True}


def kv_bytes_bf16(tokens: int, batch: int = BATCH) -> int:
    """Bytes of the bf16 K/V of ``tokens`` tokens over every layer (what DynamicCache holds)."""
    cfg = LLAMA3_8B
    return 2 * cfg["num_hidden_layers"] * batch * cfg["num_key_value_heads"] * tokens * cfg["head_dim"] * 2


def cache_bytes(cache) -> int:
    """``cache.nbytes`` when the cache has it, else the bytes of its layers' key/value tensors."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


@torch.inference_mode()
def prefill(model, make_cache: Callable, input_ids: torch.Tensor):
    """A new cache filled with ``input_ids``: (cache, next token ids [B, 1], chunk size used or None)."""
    for chunk in PREFILL_CHUNKS:
        cache = make_cache()
        try:
            step = chunk or input_ids.shape[1]
            for start in range(0, input_ids.shape[1], step):
                out = model(input_ids[:, start : start + step], **_cache_kwargs(model, cache), logits_to_keep=1)
            torch.cuda.synchronize()
            return cache, out.logits[:, -1:].argmax(-1), chunk
        except torch.cuda.OutOfMemoryError:
            print(f"    prefill out of memory with chunk={chunk}; retrying smaller", flush=True)
        cache = out = None
        gc.collect()
        torch.cuda.empty_cache()
    raise torch.cuda.OutOfMemoryError("prefill did not fit with any chunk size")


def _synchronize_all() -> None:
    """Wait for every GPU (a model split over several devices finishes a step on the last one)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


@torch.inference_mode()
def decode(model, cache, next_ids: torch.Tensor) -> tuple[list[float], list[int]]:
    """Run WARMUP + DECODE_STEPS greedy steps; (seconds per timed step, peak extra bytes of the current device per
    timed step)."""
    times, peaks = [], []
    for i in range(WARMUP_STEPS + DECODE_STEPS):
        _synchronize_all()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = model(next_ids, **_cache_kwargs(model, cache))
        next_ids = out.logits[:, -1:].argmax(-1)
        _synchronize_all()
        elapsed = time.perf_counter() - start
        del out
        if i >= WARMUP_STEPS:
            times.append(elapsed)
            peaks.append(torch.cuda.max_memory_allocated() - before)
    return times, peaks


def prefill_case(name: str, make_cache: Callable, model, input_ids, record) -> dict | None:
    """Prefill one cache kind: {"cache", "next_ids", "bytes_per_token"}, or None after recording ``<name>_oom`` /
    ``<name>_failed``."""
    print(f"  {name}: prefill B={BATCH} x {CONTEXT} tokens", flush=True)
    try:
        start = time.perf_counter()
        cache, next_ids, chunk = prefill(model, make_cache, input_ids)
        record(f"e2e_{name}_prefill_s_32k", time.perf_counter() - start, "s", f"chunk={chunk or 'none'}")
        return {"cache": cache, "next_ids": next_ids, "bytes_per_token": cache_bytes(cache) / (BATCH * CONTEXT)}
    except torch.cuda.OutOfMemoryError:
        traceback.print_exc()
        record(f"e2e_{name}_oom", 1, "flag", "0")
    except Exception:
        traceback.print_exc()
        record(f"e2e_{name}_failed", 1, "flag", "0")
    gc.collect()
    torch.cuda.empty_cache()
    return None


def decode_pass(name: str, case: dict) -> float | None:
    """One timed decode pass of a prefilled case: tokens/s (median step), and its peak extra memory in ``case``."""
    try:
        times, peaks = decode(case["model"], case["cache"], case["next_ids"])
    except Exception:
        traceback.print_exc()
        return None
    case["peak_fraction"] = max(case.get("peak_fraction", 0.0), max(peaks) / kv_bytes_bf16(CONTEXT))
    return BATCH / statistics.median(times)


def run(record) -> None:
    """Entry point for benchmarks/run_gpu.py: every cache prefilled once, then PASSES interleaved decode passes (one
    per cache in turn), so the host's drift hits every cache alike; medians and spreads over the passes."""
    from flashquant_hf import TurboQuantCache
    from flashquant_hf.backend import resolve_backend
    from transformers import DynamicCache

    began = time.perf_counter()
    model = build_model()
    record("e2e_model_build_s", time.perf_counter() - began, "s")
    generator = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, LLAMA3_8B["vocab_size"], (BATCH, CONTEXT), device="cuda", generator=generator)
    record("e2e_tq_backend_is_cuda", float(resolve_backend(input_ids[:1, :1].float()) == "cuda"), "flag")
    for op in ("compress", "tq_decode", "merge_partials"):  # a missing kernel means the PyTorch reference ran
        present = importlib.util.find_spec(f"flashquant_hf.kernels.{op}") is not None
        record(f"e2e_kernel_{op}_present", float(present), "flag")

    kinds = (("turboquant", TurboQuantCache), ("dynamic", DynamicCache),
             ("turboquant_bits3", lambda: TurboQuantCache(bits=3)),
             ("turboquant_bits2p5", lambda: TurboQuantCache(bits=2.5)))
    cases = {}
    for name, make_cache in kinds:
        if time.perf_counter() - began > TIME_BUDGET_S:
            record(f"e2e_{name}_skipped_time_budget", 1, "flag", "0")
            continue
        case = prefill_case(name, make_cache, model, input_ids, record)
        if case is not None:
            cases[name] = {**case, "model": model, "rates": []}
    for _ in range(PASSES):
        for name, case in cases.items():
            rate = decode_pass(name, case)
            if rate is not None:
                case["rates"].append(rate)
    for name, case in cases.items():
        if case["rates"]:
            record(f"e2e_{name}_decode_tokens_per_s_32k", statistics.median(case["rates"]), "tok/s",
                   f"spread {relative_spread(case['rates']):.2f}")
        record(f"e2e_{name}_kv_bytes_per_token_32k", case["bytes_per_token"], "B/token")
        if "peak_fraction" in case:
            record(f"e2e_{name}_decode_peak_extra_mem_fraction_32k", case["peak_fraction"], "fraction")

    def ratio(numerator: str, denominator: str, metric: str, target: str | None) -> None:
        a, b = cases.get(numerator), cases.get(denominator)
        if a is None or b is None or not a["rates"] or len(a["rates"]) != len(b["rates"]):
            return
        pairs = [x / y for x, y in zip(a["rates"], b["rates"])]
        record(metric, statistics.median(pairs), "x", target)
        record(f"{metric}_spread", relative_spread(pairs), "fraction")
        print(f"    {metric} per pass: " + " ".join(f"{p:.3f}" for p in pairs), flush=True)

    tq, dyn = cases.get("turboquant"), cases.get("dynamic")
    if tq is not None and "peak_fraction" in tq:
        record("decode_peak_extra_mem_fraction_32k", tq["peak_fraction"], "fraction", "< 0.05")
        # DynamicCache holds exactly the bf16 K/V; computed rather than measured if its case did not run.
        dyn_bytes = dyn["bytes_per_token"] if dyn is not None else kv_bytes_bf16(CONTEXT) / (BATCH * CONTEXT)
        record("max_context_ratio", dyn_bytes / tq["bytes_per_token"], "x", ">= 3.5")
    ratio("turboquant", "dynamic", "e2e_decode_tokens_per_s_ratio_32k", ">= 1.0")
    ratio("turboquant_bits3", "turboquant", "e2e_decode_tokens_per_s_ratio_bits3_vs_bits4", ">= 1.0")
    ratio("turboquant_bits2p5", "turboquant", "e2e_decode_tokens_per_s_ratio_bits2p5_vs_bits4", ">= 1.0")
    cases.clear()
    gc.collect()
    torch.cuda.empty_cache()
    record("e2e_total_s", time.perf_counter() - began, "s", "< 300")


def print_record(name, value, unit, target=None) -> None:
    """A ``record`` for running a benchmark module on its own: prints the row."""
    print(f"{name:<48} {value:>12.4g} {unit:<9} {target or ''}", flush=True)


if __name__ == "__main__":
    run(print_record)
