"""Decode-faithful perplexity evaluation of KV caches (``flashquant-hf ppl``, ``python -m flashquant_hf.eval``).

>>> from flashquant_hf.eval import decode_perplexity, evaluate, parse_cache_spec  # doctest: +SKIP
"""

from .errors import EvalInputError
from .perplexity import PerplexityRun, decode_perplexity, kv_nbytes
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
    "parse_cache_spec",
    "token_window",
]
