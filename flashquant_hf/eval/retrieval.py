"""Needle-in-a-haystack retrieval through each cache: the context as one prefill, the question after it.

Per trial the context's K/V are computed once with exact attention and then given to every cache as one
prefill update per layer: exactly what a one-chunk prefill through that cache stores, because a cache's first
prefill is attended with exact K/V whatever it stores. The question is then fed as a later chunk and the answer
generated greedily, both attending over what the cache stored (compressed K/V outside the exact sinks and window).

The haystack before the needle is the same for every trial of one length, and causal attention makes its K/V
independent of what follows: they are computed once per length, up to the deepest needle asked for, and only the
needle and the filler after it are run per trial.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .needle import ANSWER_TOKENS, NeedlePrompt, PromptParts, build_prompt, is_correct, pass_key
from .perplexity import forward_kwargs, kv_elements, kv_nbytes
from .runner import BF16_BYTES, build_cache
from .specs import DYNAMIC, CacheSpec, config_as_dict

States = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, shape: [1, H_kv, N, D] each


@dataclass
class Trial:
    """One needle: where it was, and what each cache answered."""

    length: int
    depth: float
    index: int
    prompt: NeedlePrompt
    answers: dict[str, str] = field(default_factory=dict)
    correct: dict[str, bool] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly: the requested and the actual depth, token positions, answers and scores."""
        p = self.prompt
        return {
            "length": self.length, "depth": self.depth, "index": self.index, "key": p.key,
            "needle_depth": p.depth, "needle_token": p.needle_start, "needle_from_end": len(p.context) - p.needle_start,
            "context_tokens": len(p.context), "prompt_tokens": p.prompt_tokens,
            "answers": self.answers, "correct": self.correct,
        }


def layer_states(cache) -> States:
    """Each layer's exact keys and values from a DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def replay(cache, states: States):
    """Give ``states`` to an empty ``cache`` as one prefill update per layer (what the model's prefill does)."""
    for layer_idx, (keys, values) in enumerate(states):
        # Fresh tensor objects: a cache may tag what it receives, and the same states go to every cache.
        cache.update(keys.view_as(keys), values.view_as(values), layer_idx)
    return cache


@torch.inference_mode()
def prefill_states(model, ids: Sequence[int], prefix: States | None = None) -> States:
    """Exact K/V of ``prefix``'s tokens followed by ``ids``, computed with a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if prefix is not None:
        replay(cache, prefix)
    kwargs, extra = forward_kwargs(model, cache)
    model(input_ids=torch.tensor([list(ids)], device=model.device), **kwargs, **extra)
    return layer_states(cache)


def _is_digit_token(tokenizer, token: int) -> bool:
    return tokenizer.decode([token]).strip().isdigit()


def _stop_tokens(model, tokenizer) -> set[int]:
    """End-of-turn ids: the tokenizer's eos and the model's generation config's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, (list, tuple)) else [configured]
    return {t for t in (tokenizer.eos_token_id, *configured) if t is not None}


@torch.inference_mode()
def ask(model, tokenizer, cache, question: Sequence[int], max_new_tokens: int = ANSWER_TOKENS) -> str:
    """Feed ``question`` as one chunk, then generate greedily; stop after the first number or at end of turn."""
    kwargs, extra = forward_kwargs(model, cache)
    ids = torch.tensor([list(question)], device=model.device)
    out = model(input_ids=ids, **kwargs, **extra)
    stop = _stop_tokens(model, tokenizer)
    generated: list[int] = []
    for step in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token in stop:
            break
        generated.append(token)
        seen_digit = any(_is_digit_token(tokenizer, t) for t in generated[:-1])
        if seen_digit and not _is_digit_token(tokenizer, token):
            break  # the number is complete
        if step + 1 < max_new_tokens:
            out = model(input_ids=torch.tensor([[token]], device=model.device), **kwargs)
    return tokenizer.decode(generated)


def _progress(total: int, enabled: bool):
    if not enabled:
        return nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="needle", dynamic_ncols=True, leave=False, mininterval=0.5)


def _footprint(rows: dict[str, dict[str, Any]], spec: CacheSpec, cache, length_idx: int) -> None:
    row = rows[spec.name]
    if row["kv_bytes"][length_idx] is None:
        row["kv_bytes"][length_idx] = kv_nbytes(cache)
        if spec.is_dynamic:
            row["bf16_kv_bytes"][length_idx] = BF16_BYTES * (kv_elements(cache) or 0)
        elif row["config"] is None and hasattr(cache, "config"):
            row["config"] = config_as_dict(cache.config)


def run_retrieval(
    model,
    tokenizer,
    parts: PromptParts,
    lengths: Sequence[int],
    depths: Sequence[float],
    needles: int,
    specs: Sequence[CacheSpec],
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Pass-key retrieval accuracy per (length, depth) for DynamicCache (first row) and each spec.

    Parameters
    ----------
    model, tokenizer
        A causal LM in eval mode and its tokenizer.
    parts
        ``needle.prompt_parts(tokenizer)``.
    lengths
        Prompt budgets in tokens (context + question + answer).
    depths
        Needle depths, fractions of the filler in [0, 1].
    needles
        Needles (distinct random keys) per (length, depth) cell.
    specs
        TurboQuant rows; DynamicCache is added in front.
    seed
        Fixes every key (``needle.pass_key``).
    progress
        One tqdm bar over all needles.

    Returns
    -------
    dict
        ``{"results": [row, ...], "trials": [trial, ...]}``; a row holds ``name``, ``config``, ``correct`` and
        ``accuracy`` per length, ``cells`` (accuracy per length and depth), and ``kv_bytes`` / ``bf16_kv_bytes`` /
        ``compression`` per length (after the context prefill).
    """
    specs = [CacheSpec(DYNAMIC)] + [s for s in specs if not s.is_dynamic]
    empty = [None] * len(lengths)
    rows = {s.name: {"name": s.name, "config": None, "kv_bytes": list(empty), "bf16_kv_bytes": list(empty)}
            for s in specs}
    trials: list[Trial] = []
    with _progress(len(lengths) * len(depths) * needles, progress) as bar:
        for length_idx, length in enumerate(lengths):
            prompts = {(depth, index): build_prompt(tokenizer, parts, length, depth,
                                                    pass_key(seed, length, depth, index))
                       for depth in depths for index in range(needles)}
            # Needle-free: the head and the filler before the deepest needle of this length, and no further.
            deepest = max(prompts.values(), key=lambda p: p.needle_start)
            shared_ids = deepest.context[: deepest.needle_start]
            shared = prefill_states(model, shared_ids)
            for depth in depths:
                for index in range(needles):
                    prompt = prompts[(depth, index)]
                    cut = prompt.needle_start
                    assert prompt.context[:cut] == shared_ids[:cut], "the needle-free prefix must be shared"
                    prefix = [(k[:, :, :cut], v[:, :, :cut]) for k, v in shared]
                    states = prefill_states(model, prompt.context[cut:], prefix)
                    trial = Trial(length, depth, index, prompt)
                    for spec in specs:
                        cache = replay(build_cache(spec, model), states)
                        _footprint(rows, spec, cache, length_idx)
                        trial.answers[spec.name] = answer = ask(model, tokenizer, cache, prompt.question)
                        trial.correct[spec.name] = is_correct(answer, prompt.key)
                        del cache
                    trials.append(trial)
                    if bar is not None:
                        bar.set_description(f"length {length} depth {depth:.2f}")
                        bar.update(1)
            del shared
    results = [_summarise(rows[s.name], trials, lengths, depths) for s in specs]
    # The DynamicCache holds the exact K/V of the context: its element count sizes them in bf16.
    base = results[0]["bf16_kv_bytes"]
    for row in results:
        row["bf16_kv_bytes"] = list(base)
        row["compression"] = [b / k if b and k else None for b, k in zip(base, row["kv_bytes"])]
    return {"results": results, "trials": [t.as_dict() for t in trials]}


def _summarise(row: dict[str, Any], trials: list[Trial], lengths, depths) -> dict[str, Any]:
    name = row["name"]

    def hits(length, depth=None) -> list[bool]:
        return [t.correct[name] for t in trials if t.length == length and (depth is None or t.depth == depth)]

    correct = [sum(hits(n)) for n in lengths]
    counts = [len(hits(n)) for n in lengths]
    return {
        **row,
        "correct": correct,
        "needles": counts,
        "accuracy": [c / n if n else None for c, n in zip(correct, counts)],
        "cells": [[_mean(hits(n, d)) for d in depths] for n in lengths],
    }


def _mean(values: list[bool]) -> float | None:
    return sum(values) / len(values) if values else None


PER_LENGTH = ("correct", "needles", "accuracy", "cells", "kv_bytes", "bf16_kv_bytes", "compression")


def merge_runs(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``niah`` document from runs over different lengths, or different depths of one length.

    The runs must share the model, needles per cell, seed and caches, and no (length, depth) cell may be in two
    runs. Lengths and depths are the union of the runs', in order; a length's counts are summed over the runs
    that hold it, its cells taken from the run that holds each depth (None where no run does), and its byte
    counts from the first run that holds it. Trials are kept, ``wall_s`` summed; the rest is the first run's.
    """
    first = documents[0]
    for doc in documents[1:]:
        for key in ("model", "needles_per_cell", "seed"):
            if doc[key] != first[key]:
                raise ValueError(f"runs differ in `{key}`: {first[key]!r} and {doc[key]!r}")
        if [r["name"] for r in doc["results"]] != [r["name"] for r in first["results"]]:
            raise ValueError("runs differ in their caches")
    where: dict[tuple[int, float], tuple[dict[str, Any], int, int]] = {}  # (length, depth) -> (run, indices)
    for doc in documents:
        for i, length in enumerate(doc["lengths"]):
            for j, depth in enumerate(doc["depths"]):
                if (length, depth) in where:
                    raise ValueError(f"runs overlap in their lengths and depths: {length} tokens, depth {depth}")
                where[(length, depth)] = (doc, i, j)
    lengths = sorted({length for length, _ in where})
    depths = sorted({depth for _, depth in where})
    results = []
    for row_idx, row in enumerate(first["results"]):
        merged = {**row, **{key: [] for key in PER_LENGTH}}
        for length in lengths:
            runs = {id(doc): (doc["results"][row_idx], i) for (n, _), (doc, i, _) in where.items() if n == length}
            sources = list(runs.values())
            correct = sum(source["correct"][i] for source, i in sources)
            needles = sum(source["needles"][i] for source, i in sources)
            cells = []
            for depth in depths:
                doc, i, j = where.get((length, depth), (None, 0, 0))
                cells.append(None if doc is None else doc["results"][row_idx]["cells"][i][j])
            source, i = sources[0]
            merged["correct"].append(correct)
            merged["needles"].append(needles)
            merged["accuracy"].append(correct / needles if needles else None)
            merged["cells"].append(cells)
            for key in ("kv_bytes", "bf16_kv_bytes", "compression"):
                merged[key].append(source[key][i])
        merged["config"] = next((d["results"][row_idx]["config"] for d in documents
                                 if d["results"][row_idx]["config"] is not None), None)
        results.append(merged)
    trials = sorted((t for doc in documents for t in doc["trials"]), key=lambda t: (t["length"], t["depth"]))
    wall_s = sum(doc.get("wall_s", 0.0) for doc in documents)
    return {**first, "lengths": lengths, "depths": depths, "wall_s": wall_s, "results": results, "trials": trials}
