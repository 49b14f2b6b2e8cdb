"""End-to-end decode with TurboQuantCache vs DynamicCache on a Llama-3-8B-shaped random model (bf16, GPU).

    python benchmarks/run_gpu.py --only e2e --skip-tests

Both caches are prefilled with the same random 32K-token prompts (B=8; one forward with ``logits_to_keep=1``,
in chunks if one forward does not fit), then timed over the same decode steps (the loop ``generate`` runs:
one forward of one token per sequence, greedy next token). Records:

- ``e2e_decode_tokens_per_s_ratio_32k``: TurboQuantCache tokens/s over DynamicCache tokens/s (target >= 1.0);
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

BATCH = 8
CONTEXT = 32 * 1024
DECODE_STEPS = 16
WARMUP_STEPS = 2
PREFILL_CHUNKS = (None, 8192, 2048)  # one forward first; smaller chunks only after an out-of-memory error
TIME_BUDGET_S = 200.0
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def build_model():
    """The random Llama-3-8B-shaped model, built directly on the GPU in bf16 (sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA3_8B)
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


def run_case(name: str, make_cache: Callable, model, input_ids, record) -> dict | None:
    """Prefill + decode one cache kind; records its numbers, or ``<name>_oom`` / ``<name>_failed``."""
    print(f"  {name}: prefill B={BATCH} x {CONTEXT} tokens", flush=True)
    cache = None
    try:
        start = time.perf_counter()
        cache, next_ids, chunk = prefill(model, make_cache, input_ids)
        prefill_s = time.perf_counter() - start
        nbytes = cache_bytes(cache)
        times, peaks = decode(model, cache, next_ids)
    except torch.cuda.OutOfMemoryError:
        traceback.print_exc()
        record(f"e2e_{name}_oom", 1, "flag", "0")
        return None
    except Exception:
        traceback.print_exc()
        record(f"e2e_{name}_failed", 1, "flag", "0")
        return None
    finally:
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    step_s = statistics.median(times)
    result = {
        "tokens_per_s": BATCH / step_s,
        "bytes_per_token": nbytes / (BATCH * CONTEXT),
        "peak_fraction": max(peaks) / kv_bytes_bf16(CONTEXT),
    }
    record(f"e2e_{name}_prefill_s_32k", prefill_s, "s", f"chunk={chunk or 'none'}")
    record(f"e2e_{name}_decode_tokens_per_s_32k", result["tokens_per_s"], "tok/s")
    record(f"e2e_{name}_kv_bytes_per_token_32k", result["bytes_per_token"], "B/token")
    record(f"e2e_{name}_decode_peak_extra_mem_fraction_32k", result["peak_fraction"], "fraction")
    return result


def run(record) -> None:
    """Entry point for benchmarks/run_gpu.py."""
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

    results = {}
    for name, make_cache in (("turboquant", TurboQuantCache), ("dynamic", DynamicCache)):
        if time.perf_counter() - began > TIME_BUDGET_S:
            record(f"e2e_{name}_skipped_time_budget", 1, "flag", "0")
            continue
        results[name] = run_case(name, make_cache, model, input_ids, record)

    tq, dyn = results.get("turboquant"), results.get("dynamic")
    if tq is not None:
        record("decode_peak_extra_mem_fraction_32k", tq["peak_fraction"], "fraction", "< 0.05")
        # DynamicCache holds exactly the bf16 K/V; computed rather than measured if its case did not run.
        dyn_bytes = dyn["bytes_per_token"] if dyn is not None else kv_bytes_bf16(CONTEXT) / (BATCH * CONTEXT)
        record("max_context_ratio", dyn_bytes / tq["bytes_per_token"], "x", ">= 3.5")
    if tq is not None and dyn is not None:
        record("e2e_decode_tokens_per_s_ratio_32k", tq["tokens_per_s"] / dyn["tokens_per_s"], "x", ">= 1.0")
    record("e2e_total_s", time.perf_counter() - began, "s", "< 240")


def print_record(name, value, unit, target=None) -> None:
    """A ``record`` for running a benchmark module on its own: prints the row."""
    print(f"{name:<48} {value:>12.4g} {unit:<9} {target or ''}", flush=True)


if __name__ == "__main__":
    run(print_record)
