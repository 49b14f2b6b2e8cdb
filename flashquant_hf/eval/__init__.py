"""Evaluation of KV caches: decode-faithful perplexity (``flashquant-hf ppl``, ``python -m flashquant_hf.eval``) and
pass-key retrieval (``flashquant-hf niah``).

>>> from flashquant_hf.eval import decode_perplexity, evaluate, parse_cache_spec, run_retrieval  # doctest: +SKIP
"""

from .errors import EvalInputError
from .needle import prompt_parts
from .perplexity import PerplexityRun, decode_perplexity, kv_nbytes
from .retrieval import merge_runs, run_retrieval
from .runner import build_cache, evaluate
from .specs import PRESETS, CacheSpec, parse_cache_spec
from .text import default_text, load_text, token_window

__all__ = [
    "PRESETS",
    "CacheSpec",
    "EvalInputError",
    "PerplexityRun",
    "build_cache",
    "decode_perplexity",
    "default_text",
    "evaluate",
    "kv_nbytes",
    "load_text",
    "merge_runs",
    "parse_cache_spec",
    "prompt_parts",
    "run_retrieval",
    "token_window",
]
