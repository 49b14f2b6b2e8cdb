"""Decode over a model split across two GPUs: tokens/s of the Llama-3-8B-shaped random model with
TurboQuantCache, layers split over GPUs 0 and 1 by accelerate's ``device_map`` machinery, over the same model
and context on GPU 0 alone (B=8, 32K context; the prefill and decode steps of ``bench_e2e``).

    python benchmarks/run_gpu.py --only multi_gpu --skip-tests

Records ``multi_gpu_decode_tokens_per_s_ratio`` (split / one GPU; target >= 1.0). With fewer than two GPUs it
records nothing and says so.
"""

from __future__ import annotations

import gc
import statistics

import torch

from benchmarks.bench_e2e import BATCH, CONTEXT, LLAMA3_8B, build_model, decode, prefill, print_record


def decode_tokens_per_s(model, input_ids: torch.Tensor) -> float:
    """Prefill a TurboQuantCache with ``input_ids``, then the median tokens/s of ``bench_e2e``'s timed decode steps."""
    from flashquant_hf import TurboQuantCache

    cache, next_ids, _ = prefill(model, TurboQuantCache, input_ids)
    times, _ = decode(model, cache, next_ids)
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    return BATCH / statistics.median(times)


def split_over_two_gpus(model):
    """``model`` dispatched with whole decoder layers on GPUs 0 and 1 (about half the weights each), as
    ``from_pretrained(device_map="auto", max_memory=...)`` would place them."""
    from accelerate import dispatch_model, infer_auto_device_map

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = infer_auto_device_map(model, max_memory={0: int(0.55 * weights), 1: 2 * weights},
                                       no_split_module_classes=["LlamaDecoderLayer"])
    if set(device_map.values()) != {0, 1}:
        raise RuntimeError(f"the device map does not use both GPUs: {sorted(set(device_map.values()))}")
    return dispatch_model(model, device_map=device_map)


def run(record) -> None:
    """Entry point for benchmarks/run_gpu.py."""
    if torch.cuda.device_count() < 2:
        print("  multi_gpu: skipped, this machine has fewer than two GPUs", flush=True)
        return
    model = build_model()
    generator = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, LLAMA3_8B["vocab_size"], (BATCH, CONTEXT), device="cuda", generator=generator)
    one = decode_tokens_per_s(model, input_ids)
    record("multi_gpu_one_gpu_decode_tokens_per_s_32k", one, "tok/s")
    model = split_over_two_gpus(model)
    two = decode_tokens_per_s(model, input_ids)
    record("multi_gpu_two_gpus_decode_tokens_per_s_32k", two, "tok/s")
    record("multi_gpu_decode_tokens_per_s_ratio", two / one, "x", ">= 1.0")


if __name__ == "__main__":
    run(print_record)
