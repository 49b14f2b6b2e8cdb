"""Evaluate DynamicCache and every requested TurboQuant configuration on the same tokens."""

from __future__ import annotations

import inspect
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch

from .perplexity import PerplexityRun, decode_perplexity
from .specs import DYNAMIC, CacheSpec, config_as_dict, make_config, turboquant_api

BF16_BYTES = 2
PROJECTED_TOKENS = 32768  # the length the "at 32K" compression is projected to


def build_cache(spec: CacheSpec, model, seed: int | None = None):
    """An empty cache for one row: DynamicCache for the baseline, else TurboQuantCache(config) with ``seed``."""
    if spec.is_dynamic:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    _, cache_cls = turboquant_api()
    extra = {} if seed is None else {"seed": seed}
    config = make_config(spec.overrides, spec_text=spec.name, **extra)
    if "model_config" in inspect.signature(cache_cls).parameters:
        # Built up front from the model's layer types, as DynamicCache(config=model.config) is.
        return cache_cls(config=config, model_config=model.config)
    return cache_cls(config=config)


def _progress(total: int, enabled: bool):
    if not enabled:
        return nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", dynamic_ncols=True, leave=False, mininterval=0.5)


def _row(spec: CacheSpec, runs: list[PerplexityRun], seeds: list[int | None], config, seconds: float) -> dict:
    ppls = [run.ppl for run in runs]
    projected = runs[0].projected_kv_bytes(PROJECTED_TOKENS)
    return {
        "name": spec.name,
        "ppl": statistics.fmean(ppls),
        "ppl_std": statistics.stdev(ppls) if len(ppls) > 1 else 0.0,
        "ppl_min": min(ppls),
        "ppl_max": max(ppls),
        "ppl_per_seed": ppls,
        "seeds": seeds,
        "kv_bytes": runs[0].kv_bytes,
        "tokens_per_s": statistics.fmean(run.tokens_per_s for run in runs),
        "prefill_s": statistics.fmean(run.prefill_s for run in runs),
        "seconds": seconds,
        "kv_tokens": runs[0].kv_tokens,
        "kv_bytes_32k": float("nan") if projected is None else projected,
        "config": None if config is None else config_as_dict(config),
    }


def evaluate(
    model,
    input_ids: torch.Tensor,
    prefix: int,
    specs: list[CacheSpec],
    seeds: list[int] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Decode-faithful perplexity of DynamicCache (first row, named ``"dynamic"``) and each spec.

    Parameters
    ----------
    model
        A causal LM in eval mode.
    input_ids
        int64, shape: [1, P + T]; the same tokens for every row.
    prefix
        P, the prefilled tokens.
    specs
        TurboQuant rows (CacheSpec with overrides); DynamicCache is added in front.
    seeds
        Rotation seeds each TurboQuant row is averaged over (None: the config's own seed, one run).
    progress
        Show one tqdm bar over every scored token of every run.

    Returns
    -------
    list of dict
        One row per cache: name, ppl (mean over seeds), ppl_std, delta_pct (vs dynamic), kv_bytes, compression
        (bf16 bytes of the same K/V / kv_bytes), compression_32k (the same projected to 32768 tokens, every further
        token compressed), tokens_per_s, seconds (the row's wall time, all seeds), and the resolved config.
    """
    scored = input_ids.shape[1] - prefix
    rows_to_run = [CacheSpec(DYNAMIC)] + [s for s in specs if not s.is_dynamic]
    seed_list: list[int | None] = list(seeds) if seeds else [None]
    total_runs = 1 + (len(rows_to_run) - 1) * len(seed_list)
    rows, bf16_bytes = [], 0
    with _progress(total_runs * scored, progress) as bar:
        for spec in rows_to_run:
            runs, used_seeds, config = [], [], None
            started = time.perf_counter()
            for seed in [None] if spec.is_dynamic else seed_list:
                cache = build_cache(spec, model, seed)
                if bar is not None:
                    bar.set_description(spec.name if seed is None else f"{spec.name} seed={seed}")
                runs.append(decode_perplexity(model, input_ids, prefix, cache, progress=bar))
                if spec.is_dynamic:
                    # The baseline holds the exact K/V of these tokens: its element count sizes them in bf16.
                    bf16_bytes = BF16_BYTES * (runs[-1].kv_elements or 0)
                else:
                    config = cache.config if hasattr(cache, "config") else None
                    used_seeds.append(getattr(config, "seed", seed))
                del cache
            rows.append(_row(spec, runs, used_seeds, config, time.perf_counter() - started))
    base = rows[0]
    for row in rows:
        row["delta_pct"] = 100.0 * (row["ppl"] / base["ppl"] - 1.0)
        row["bf16_kv_bytes"] = bf16_bytes
        row["compression"] = bf16_bytes / row["kv_bytes"] if row["kv_bytes"] else float("nan")
        bf16_32k = bf16_bytes / row["kv_tokens"] * PROJECTED_TOKENS if row["kv_tokens"] else float("nan")
        row["compression_32k"] = bf16_32k / row["kv_bytes_32k"] if row["kv_bytes_32k"] > 0 else float("nan")
    return rows
