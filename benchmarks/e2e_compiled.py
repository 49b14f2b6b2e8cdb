"""Compiled decode: a static TurboQuantCache under the forward ``generate`` compiles (CUDA graphs) against
transformers' StaticCache under the same compile, and against eager DynamicCache (Llama-3-8B-shaped random bf16
model, B=8, GPU).

    python benchmarks/run_gpu.py --only e2e_compiled --skip-tests                 # 32K and 8K, every preset
    FLASHQUANT_E2E_CONTEXTS=32768 FLASHQUANT_E2E_PRESETS=4 python benchmarks/run_gpu.py --only e2e_compiled \
        --skip-tests                                                              # a part, recorded
    python benchmarks/e2e_compiled.py --contexts 8192 --layers 4 --steps 8        # smoke run, prints the rows

Per context, in two phases (compiled StaticCache and the TurboQuantCache presets; then the compiled
TurboQuantCache() against eager DynamicCache, which does not fit beside the others at 32K), every cache is
prefilled once with the same random prompts (one forward, ``logits_to_keep=1``) and stays resident while the
phase's caches take turns, pass after pass (``--passes``, >= 3), each pass timing ``--steps`` decode steps of one
token per sequence after ``WARMUP_STEPS`` untimed ones (which record the CUDA graphs). The
compiled forward is transformers' own (``model.get_compiled_call`` with the model's generation compile config,
as ``generate`` uses it for a StaticCache). Records, per context ``<n>k``:

- ``e2e_compiled_decode_ratio_vs_static_<n>k``: compiled TurboQuantCache() tokens/s over compiled StaticCache
  tokens/s, median over the interleaved pairs, with ``*_spread`` ((max - min) / median); the same with
  ``_bits3`` / ``_bits2p5`` for the presets;
- ``e2e_compiled_decode_tokens_per_s_<n>k`` (TurboQuantCache, compiled) and its ratio to eager DynamicCache of the
  same run, ``e2e_compiled_decode_ratio_vs_eager_dynamic_<n>k`` (target >= 5 at 32K; pairs of the second phase);
- ``e2e_compiled_peak_mem_extra_fraction_<n>k``: the largest rise of allocated memory over a pass (graph pools
  included) of the compiled TurboQuantCache minus that of the compiled StaticCache, over the bf16 K/V size
  (target < 0.05): memory beyond weights, compressed cache and what the StaticCache run needs itself.

``--layers`` below 32 shortens compile and prefill (the LM head then weighs more in every step); the layer count is
part of every row's note.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_e2e import BATCH, LLAMA3_8B, cache_bytes, kv_bytes_bf16  # noqa: E402
from benchmarks.bench_e2e import build_model as build_llama3_8b  # noqa: E402
from benchmarks.timing import relative_spread  # noqa: E402

CONTEXTS = (32 * 1024, 8 * 1024)
PRESETS = {"": {}, "_bits3": {"bits": 3}, "_bits2p5": {"bits": 2.5}}  # metric suffix -> TurboQuantCache settings
DECODE_STEPS = 16
WARMUP_STEPS = 3  # cudagraph trees record on the second call of a graph
PASSES = 3
TIME_BUDGET_S = 540.0
PHASES = ("static", "dynamic")  # run_context's two phases
STATIC_PREFILL_CHUNK = 2048  # StaticCache prefill chunk: its bool mask is B x chunk x capacity bytes (0.5 GB at 32K)


def build_model(layers: int):
    """The random Llama-3-8B-shaped model with ``layers`` decoder layers, bf16 on the GPU (sdpa attention), that
    never stops at an end-of-sequence token."""
    model = build_llama3_8b(layers)
    model.generation_config.eos_token_id = None
    return model


def compiled_forward(model) -> Callable:
    """The compiled ``__call__`` that ``generate`` uses for a compileable cache."""
    return model.get_compiled_call(model.generation_config.compile_config)


@torch.inference_mode()
def prefill(model, cache, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Fill ``cache`` with ``input_ids`` in one forward, or in forwards of ``chunk`` tokens; the next token ids
    [B, 1]."""
    from flashquant_hf.cache import cache_kwargs

    step = chunk or input_ids.shape[1]
    for start in range(0, input_ids.shape[1], step):
        out = model(input_ids[:, start : start + step], **cache_kwargs(model, cache), use_cache=True,
                    logits_to_keep=1)
    torch.cuda.synchronize()
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def decode_pass(model, forward: Callable, case: dict, steps: int) -> float:
    """WARMUP_STEPS + ``steps`` greedy steps of one case; its tokens/s (median step). Keeps the case's next ids and
    the largest rise of allocated memory over the pass."""
    from flashquant_hf.cache import cache_kwargs

    next_ids = case["next_ids"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(WARMUP_STEPS + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward(next_ids, **cache_kwargs(model, case["cache"]), use_cache=True)
        next_ids = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
        del out
    case["next_ids"] = next_ids
    case["peak_extra"] = max(case.get("peak_extra", 0), torch.cuda.max_memory_allocated() - before)
    return BATCH / statistics.median(times)


def _prefill_cases(model, makers: dict[str, tuple[Callable, Callable]], input_ids, tag: str, note: str, record,
                   began: float) -> dict[str, dict]:
    """Prefill a new cache per entry of ``makers`` (name -> (make the cache, the forward of its decode steps)).
    StaticCache in chunks of STATIC_PREFILL_CHUNK tokens: its attention masks span the whole capacity (one
    32K-token forward would build a [B, 1, 32K, 32K] mask and lose FlashAttention); DynamicCache in the same chunks,
    which bound the activations beside its bf16 K/V; a static TurboQuantCache in one forward (it takes a single
    prefill)."""
    from transformers import DynamicCache, StaticCache

    cases: dict[str, dict] = {}
    for name, (make, forward) in makers.items():
        if time.perf_counter() - began > TIME_BUDGET_S:
            record(f"e2e_compiled_{name}_skipped_time_budget_{tag}", 1, "flag", "0")
            continue
        print(f"  {name}: prefill B={BATCH} x {input_ids.shape[1]} tokens", flush=True)
        try:
            cache = make()
            started = time.perf_counter()
            chunk = STATIC_PREFILL_CHUNK if isinstance(cache, (StaticCache, DynamicCache)) else None
            next_ids = prefill(model, cache, input_ids, chunk)
            record(f"e2e_compiled_{name}_prefill_s_{tag}", time.perf_counter() - started, "s", note)
            cases[name] = {"cache": cache, "next_ids": next_ids, "forward": forward, "rates": [],
                           "bytes": cache_bytes(cache)}
        except Exception:
            traceback.print_exc()
            record(f"e2e_compiled_{name}_failed_{tag}", 1, "flag", "0")
        cache = None
        gc.collect()
        torch.cuda.empty_cache()
    return cases


def _interleave(model, cases: dict[str, dict], steps: int, passes: int, tag: str, record) -> dict[str, dict]:
    """``passes`` rounds of one decode pass per case in turn; the cases that never failed, with their rates."""
    for number in range(passes):
        for name, case in cases.items():
            started = time.perf_counter()
            try:
                case["rates"].append(decode_pass(model, case["forward"], case, steps))
            except Exception:
                traceback.print_exc()
                record(f"e2e_compiled_{name}_decode_failed_{tag}", 1, "flag", "0")
                case["failed"] = True
            if number == 0 and "first_pass_s" not in case:
                case["first_pass_s"] = time.perf_counter() - started
                record(f"e2e_compiled_{name}_first_pass_s_{tag}", case["first_pass_s"], "s", "includes compiling")
        cases = {name: case for name, case in cases.items() if not case.get("failed")}
    return cases


def run_context(model, context: int, presets: list[str], steps: int, passes: int, record, began: float,
                phases: tuple[str, ...] = PHASES) -> None:
    """One context in two phases, each prefilling its caches once and interleaving their passes: ``"static"``, the
    compiled StaticCache and every TurboQuantCache preset; then ``"dynamic"``, the compiled TurboQuantCache() again
    with eager DynamicCache (which would not fit beside the others at 32K on one GPU). At 32 layers and 32K the
    StaticCache's graphs keep its 34 GB alive, so the phases run as separate parts there (``FLASHQUANT_E2E_PHASES``)."""
    from transformers import DynamicCache, StaticCache

    from flashquant_hf import TurboQuantCache

    tag, layers = f"{context // 1024}k", model.config.num_hidden_layers
    note = f"B={BATCH}, {layers} layers"
    generator = torch.Generator(device="cuda").manual_seed(context)
    input_ids = torch.randint(0, LLAMA3_8B["vocab_size"], (BATCH, context), device="cuda", generator=generator)
    capacity = context + 2 * passes * (WARMUP_STEPS + steps) + 1
    compiled = compiled_forward(model)
    # The TurboQuantCaches first: their one-forward prefill needs the activations of a whole prompt, which fit
    # beside the weights and the compressed caches but not beside a bf16 StaticCache of 32 layers at 32K.
    makers: dict[str, tuple[Callable, Callable]] = {
        **{f"turboquant{suffix}": ((lambda s=settings: TurboQuantCache(max_cache_len=capacity, **s)), compiled)
           for suffix, settings in PRESETS.items() if suffix in presets and ("static" in phases or not suffix)},
        "static": (lambda: StaticCache(config=model.config, max_cache_len=capacity), compiled),
    }
    if "static" not in phases:  # the compiled TurboQuantCache() alone, prefilled for the second phase
        makers = {"turboquant": makers["turboquant"]}
    cases = _prefill_cases(model, makers, input_ids, tag, note, record, began)
    if "static" in phases:
        cases = _interleave(model, cases, steps, passes, tag, record)
    for name, case in cases.items():
        if not case["rates"]:  # prefilled for the second phase only
            continue
        record(f"e2e_compiled_{name}_decode_tokens_per_s_{tag}", statistics.median(case["rates"]), "tok/s",
               f"{note}, spread {relative_spread(case['rates']):.2f}")
        record(f"e2e_compiled_{name}_kv_bytes_per_token_{tag}", case["bytes"] / (BATCH * context), "B/token")

    def ratio(a: dict | None, b: dict | None, metric: str, target: str | None) -> None:
        if a is None or b is None or len(a["rates"]) != len(b["rates"]) or not a["rates"]:
            return
        pairs = [x / y for x, y in zip(a["rates"], b["rates"])]
        record(metric, statistics.median(pairs), "x", f"{target or ''} ({note})".strip())
        record(f"{metric}_spread", relative_spread(pairs), "fraction")
        print(f"    {metric} per pair: " + " ".join(f"{p:.3f}" for p in pairs), flush=True)

    targets = {"32k": ">= 1.6", "8k": ">= 1.2"}
    for suffix in PRESETS:
        ratio(cases.get(f"turboquant{suffix}"), cases.get("static"),
              f"e2e_compiled_decode_ratio_vs_static{suffix}_{tag}", targets.get(tag))
    tq = cases.get("turboquant")
    if tq is not None and tq["rates"]:
        record(f"e2e_compiled_decode_tokens_per_s_{tag}", statistics.median(tq["rates"]), "tok/s", note)
        if "static" in cases:
            extra = tq["peak_extra"] - cases["static"]["peak_extra"]
            record(f"e2e_compiled_peak_mem_extra_fraction_{tag}", extra / kv_bytes_bf16(context), "fraction",
                   "< 0.05" if tag == "32k" else None)
    # Phase 2: the compiled TurboQuantCache() (still prefilled) against eager DynamicCache.
    cases = {"turboquant": {**tq, "rates": []}} if tq is not None and "dynamic" in phases else {}
    tq = None
    gc.collect()
    torch.cuda.empty_cache()
    if cases:
        cases.update(_prefill_cases(model, {"dynamic": (DynamicCache, model)}, input_ids, tag, note, record, began))
        cases = _interleave(model, cases, steps, passes, tag, record)
        if "dynamic" in cases:
            record(f"e2e_compiled_dynamic_decode_tokens_per_s_{tag}", statistics.median(cases["dynamic"]["rates"]),
                   "tok/s", f"eager, {note}, spread {relative_spread(cases['dynamic']['rates']):.2f}")
        ratio(cases.get("turboquant"), cases.get("dynamic"), f"e2e_compiled_decode_ratio_vs_eager_dynamic_{tag}",
              ">= 5" if tag == "32k" else None)
    cases.clear()
    gc.collect()
    torch.cuda.empty_cache()


PRESET_SUFFIXES = {"4": "", "3": "_bits3", "2.5": "_bits2p5"}  # command-line / environment name -> metric suffix


def _from_environment() -> dict:
    """run()'s settings from ``FLASHQUANT_E2E_CONTEXTS`` / ``_PRESETS`` / ``_PHASES`` (space-separated) and
    ``_LAYERS``, so ``run_gpu.py --only e2e_compiled`` can run a part (each 32K context wants most of a 600 s
    command)."""
    settings: dict = {}
    if os.environ.get("FLASHQUANT_E2E_PHASES"):
        settings["phases"] = tuple(os.environ["FLASHQUANT_E2E_PHASES"].split())
        unknown = set(settings["phases"]) - set(PHASES)
        if unknown:
            raise ValueError(f"FLASHQUANT_E2E_PHASES: unknown phases {sorted(unknown)}, expected some of {PHASES}")
    if os.environ.get("FLASHQUANT_E2E_CONTEXTS"):
        settings["contexts"] = tuple(int(c) for c in os.environ["FLASHQUANT_E2E_CONTEXTS"].split())
    if os.environ.get("FLASHQUANT_E2E_PRESETS"):
        settings["presets"] = tuple(PRESET_SUFFIXES[p] for p in os.environ["FLASHQUANT_E2E_PRESETS"].split())
    if os.environ.get("FLASHQUANT_E2E_LAYERS"):
        settings["layers"] = int(os.environ["FLASHQUANT_E2E_LAYERS"])
    return settings


def run(record, contexts=None, layers: int | None = None, steps: int = DECODE_STEPS, passes: int = PASSES,
        presets: tuple[str, ...] | None = None) -> None:
    """Entry point for benchmarks/run_gpu.py (and the command line); settings not given come from the environment
    (:func:`_from_environment`), else every context and preset at 32 layers."""
    from flashquant_hf.backend import resolve_backend

    environment = _from_environment()
    contexts = contexts or environment.get("contexts", CONTEXTS)
    layers = layers or environment.get("layers", LLAMA3_8B["num_hidden_layers"])
    presets = presets or environment.get("presets", tuple(PRESETS))
    phases = environment.get("phases", PHASES)
    print(f"  contexts {contexts}, presets {presets}, phases {phases}, {layers} layers, {steps} steps x {passes} "
          "passes", flush=True)
    began = time.perf_counter()
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is not None:  # one graph per cache kind and context
        torch._dynamo.config.recompile_limit = max(limit, 64)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model = build_model(layers)
    record("e2e_compiled_model_build_s", time.perf_counter() - began, "s")
    record("e2e_compiled_tq_backend_is_cuda", float(resolve_backend(torch.zeros(1, device="cuda")) == "cuda"), "flag")
    for context in contexts:
        if time.perf_counter() - began > TIME_BUDGET_S:
            record(f"e2e_compiled_skipped_time_budget_{context // 1024}k", 1, "flag", "0")
            continue
        run_context(model, context, list(presets), steps, passes, record, began, phases)
    record("e2e_compiled_total_s", time.perf_counter() - began, "s", "< 300 per 32K context")


def main(argv: list[str] | None = None) -> None:
    from benchmarks.bench_e2e import print_record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    parser.add_argument("--steps", type=int, default=DECODE_STEPS)
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--presets", nargs="+", default=list(PRESET_SUFFIXES), choices=list(PRESET_SUFFIXES))
    args = parser.parse_args(argv)
    run(print_record, tuple(args.contexts), args.layers, args.steps, args.passes,
        tuple(PRESET_SUFFIXES[p] for p in args.presets))


if __name__ == "__main__":
    main()
