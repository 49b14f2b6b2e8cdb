"""flashquant-hf: TurboQuant-compressed KV cache for HuggingFace transformers with fused CUDA kernels."""

from .codebook import Codebook, lloyd_max_codebook
from .quantizer import CompressedTensor, TurboQuantizer
from .rotation import random_rotation

__all__ = ["Codebook", "CompressedTensor", "TurboQuantizer", "lloyd_max_codebook", "random_rotation"]
__version__ = "0.1.0"
