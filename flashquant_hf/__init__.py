"""flashquant-hf: TurboQuant-compressed KV cache for HuggingFace transformers with fused CUDA kernels."""

from .codebook import Codebook, lloyd_max_codebook
from .config import TurboQuantConfig
from .quantizer import CompressedTensor, TurboQuantizer
from .rotation import random_rotation

__all__ = [
    "Codebook",
    "CompressedTensor",
    "TurboQuantCache",
    "TurboQuantConfig",
    "TurboQuantLayer",
    "TurboQuantizer",
    "lloyd_max_codebook",
    "random_rotation",
]
__version__ = "0.1.0"

_LAZY = {"TurboQuantCache": "cache", "TurboQuantLayer": "layer"}


def __getattr__(name: str):
    # The cache classes import transformers (~2 s); only users of the cache pay for it.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
