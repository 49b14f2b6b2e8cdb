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
    "install",
    "lloyd_max_codebook",
    "random_rotation",
    "uninstall",
]
__version__ = "0.1.0"

# Names whose modules import transformers (~2 s): only users of the cache pay for it.
_LAZY = {"TurboQuantCache": "cache", "TurboQuantLayer": "layer", "install": "registration", "uninstall": "registration"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
