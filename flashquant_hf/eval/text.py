"""Text sources for the perplexity evaluation and the token window cut from them.

The default corpus needs no network: CPython's own reference documentation (``pydoc_data.topics``), present
in every Python install. ``--text-file`` reads a local file; ``--dataset`` reads a HuggingFace dataset.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .errors import EvalInputError

DEFAULT_TEXT = "pydoc_data.topics"
TOPIC_SEPARATOR = "\n\n"

# Short names for the usual perplexity corpora (name, config); anything else goes to `datasets` as given.
DATASET_ALIASES: dict[str, tuple[str, str | None]] = {
    "wikitext-2": ("wikitext", "wikitext-2-raw-v1"),
    "wikitext2": ("wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": ("wikitext", "wikitext-103-raw-v1"),
}


def default_text() -> str:
    """CPython's reference documentation: ``pydoc_data.topics`` values in sorted key order, blank-line joined."""
    from pydoc_data.topics import topics

    return TOPIC_SEPARATOR.join(topics[key] for key in sorted(topics))


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of ``path``; EvalInputError when it is missing, unreadable or empty."""
    path = Path(path)
    if not path.is_file():
        raise EvalInputError(f"`--text-file` {str(path)!r} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EvalInputError(f"`--text-file` {str(path)!r} could not be read as UTF-8 text: {err}") from None
    if not text.strip():
        raise EvalInputError(f"`--text-file` {str(path)!r} is empty")
    return text


def parse_dataset_name(spec: str) -> tuple[str, str | None]:
    """``"NAME[:CONFIG]"`` (or an alias such as ``wikitext-2``) -> (name, config)."""
    if not isinstance(spec, str) or not spec.strip():
        raise EvalInputError(f"`--dataset` must be NAME or NAME:CONFIG, got {spec!r}")
    spec = spec.strip()
    if spec in DATASET_ALIASES:
        return DATASET_ALIASES[spec]
    name, _, config = spec.partition(":")
    if not name:
        raise EvalInputError(f"`--dataset` must be NAME or NAME:CONFIG, got {spec!r}")
    return name, config or None


def load_dataset_text(spec: str, split: str = "test", column: str = "text") -> str:
    """The ``column`` of a HuggingFace dataset split, rows joined by blank lines (the usual perplexity text).

    Any failure of ``datasets`` (no network, unknown name, missing split or column) becomes one EvalInputError.
    """
    name, config = parse_dataset_name(spec)
    try:
        import datasets
    except ImportError:
        raise EvalInputError("`--dataset` needs the package `datasets`: pip install 'flashquant-hf[eval]'") from None
    # The hub client logs every retry of an unreachable host; the one-line error below says it all.
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise EvalInputError(
            f"could not load dataset {spec!r} (name {name!r}, config {config!r}, split {split!r}): {reason}"
        ) from None
    finally:
        hub_logger.setLevel(level)
    if column not in data.column_names:
        raise EvalInputError(f"dataset {spec!r} has no column {column!r}; its columns are {data.column_names}")
    text = TOPIC_SEPARATOR.join(row for row in data[column] if row)
    if not text.strip():
        raise EvalInputError(f"dataset {spec!r} split {split!r} column {column!r} holds no text")
    return text


def load_text(text_file: str | Path | None = None, dataset: str | None = None, split: str = "test") -> tuple[str, str]:
    """(text, description) from at most one source; the default corpus when neither is given."""
    if text_file is not None and dataset is not None:
        raise EvalInputError("give at most one of `--text-file` and `--dataset`")
    if text_file is not None:
        return read_text_file(text_file), str(text_file)
    if dataset is not None:
        return load_dataset_text(dataset, split=split), f"{dataset}:{split}"
    return default_text(), DEFAULT_TEXT


def token_window(tokenizer, text: str, prefix: int, tokens: int) -> torch.Tensor:
    """The first ``prefix + tokens`` token ids of ``text``.

    Returns
    -------
    torch.Tensor
        int64, shape: [1, prefix + tokens]
    """
    need = prefix + tokens
    # Tokenizing a generous head of the text gives the same leading ids as the whole text (BPE pre-splits on
    # whitespace, so only the last few ids can differ) at a fraction of the cost; fall back to all of it.
    head = text[: need * 16 + 4096]
    ids = tokenizer(head, return_tensors="pt").input_ids
    if ids.shape[1] < need + 8 and len(head) < len(text):
        ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < need:
        raise EvalInputError(
            f"the text has {ids.shape[1]} tokens, fewer than `--prefix` + `--tokens` = {prefix} + {tokens} = {need}"
        )
    return ids[:, :need].to(torch.long)
