"""The decode-faithful perplexity loop: prefill, then teacher-forced single-token steps through the cache.

Scoring a continuation in one chunked forward lets every scored token attend to exact K/V of its own chunk
and hides most of a compressed cache's error. Here each new token's K/V enters the cache before it attends,
exactly as in generation: the prefill's last logits score token ``P``, and the step that feeds token ``t``
scores token ``t + 1``.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch


@dataclass
class PerplexityRun:
    """What one pass of the loop measured.

    ``nll`` holds the negative log-likelihood of each scored token (float64, shape: [T]).
    """

    nll: torch.Tensor
    prefill_s: float
    decode_s: float
    kv_bytes: int
    kv_elements: int | None
    kv_tokens: int = 0
    further_token_bytes: float | None = None

    def projected_kv_bytes(self, tokens: int) -> float | None:
        """Bytes the cache would hold at ``tokens`` tokens: this run's bytes plus ``further_token_bytes`` for every
        further token (exact windows and sinks already full, so each further token is compressed), else None."""
        if self.further_token_bytes is None or self.kv_tokens <= 0:
            return None
        return self.kv_bytes + (tokens - self.kv_tokens) * self.further_token_bytes

    @property
    def ppl(self) -> float:
        """exp(mean nll)."""
        return math.exp(float(self.nll.mean()))

    @property
    def tokens_per_s(self) -> float:
        """Single-token decode steps per second (the prefill excluded)."""
        steps = self.nll.numel() - 1
        return steps / self.decode_s if self.decode_s > 0 else float("nan")


def kv_nbytes(cache) -> int:
    """Bytes of K/V a cache holds: ``cache.nbytes`` when it has one, else the sum over its layers' tensors."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def kv_elements(cache) -> int | None:
    """Number of K/V elements held as plain tensors (a DynamicCache); None for a cache without ``keys``."""
    if hasattr(cache, "nbytes") or not hasattr(cache, "layers"):
        return None
    return sum(
        t.numel() for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)
    )


def further_token_bytes(cache) -> float | None:
    """Bytes each further token adds to ``cache``: a TurboQuantCache's compressed bytes per token over its
    TurboQuant layers (None while one of them holds no compressed token yet; sliding layers are bounded), or a
    plain cache's bytes per held token."""
    tq_layers = [layer for layer in cache.layers if hasattr(layer, "compressed_token_nbytes")]
    if tq_layers:
        sizes = [layer.compressed_token_nbytes for layer in tq_layers]
        return None if None in sizes else float(sum(sizes))
    tokens = cache.get_seq_length()
    return kv_nbytes(cache) / tokens if tokens else None


def _nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # float64 log-softmax: the sum of a few hundred NLLs must not depend on the model dtype's rounding.
    return -torch.log_softmax(logits.double(), dim=-1).gather(-1, target[:, None]).squeeze(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_kwargs(model, cache) -> tuple[dict, dict]:
    """The cache keyword this transformers version takes, plus ``logits_to_keep`` where supported."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    # transformers >= 5.2x names the argument `cache` and warns on `past_key_values`; 5.17 knows only the latter.
    kwargs = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    return kwargs, ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


@torch.inference_mode()
def decode_perplexity(model, input_ids: torch.Tensor, prefix: int, cache, progress=None) -> PerplexityRun:
    """Decode-faithful perplexity of ``input_ids[:, prefix:]`` given ``input_ids[:, :prefix]``.

    Parameters
    ----------
    model
        A causal LM (``model(input_ids, past_key_values=..., use_cache=True).logits``).
    input_ids
        int64, shape: [1, P + T]; ``P = prefix`` tokens are prefilled, the next ``T >= 2`` are scored.
    prefix
        P, the number of prefilled tokens (>= 1).
    cache
        An empty transformers Cache (DynamicCache, TurboQuantCache, ...); it is filled in place.
    progress
        Optional tqdm-like object; ``update(1)`` is called once per scored token.

    Returns
    -------
    PerplexityRun
        per-token NLL (shape: [T]), timings and the bytes the cache holds at the end (P + T - 1 tokens).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"`input_ids` must have shape [1, P + T], got {list(input_ids.shape)}")
    total = input_ids.shape[1]
    if not 1 <= prefix <= total - 2:
        raise ValueError(f"`prefix` must be in [1, {total - 2}] for {total} tokens, got {prefix}")
    device = model.device
    ids = input_ids.to(device)
    kwargs, prefill_extra = forward_kwargs(model, cache)
    nlls = []

    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids[:, :prefix], **kwargs, **prefill_extra)
    nlls.append(_nll(out.logits[:, -1], ids[:, prefix]))
    _sync(device)
    prefill_s = time.perf_counter() - start
    if progress is not None:
        progress.update(1)

    start = time.perf_counter()
    for t in range(prefix, total - 1):
        out = model(input_ids=ids[:, t : t + 1], **kwargs)
        nlls.append(_nll(out.logits[:, -1], ids[:, t + 1]))
        if progress is not None:
            progress.update(1)
    _sync(device)
    decode_s = time.perf_counter() - start

    nll = torch.cat(nlls).cpu()
    return PerplexityRun(
        nll, prefill_s, decode_s, kv_nbytes(cache), kv_elements(cache), cache.get_seq_length(),
        further_token_bytes(cache),
    )
