"""TurboQuantConfig: every knob of the compressed KV cache, from arguments or ``FLASHQUANT_*`` variables.

Resolution order for each field: an explicit argument, else its environment variable, else the default.
The defaults are the best measured settings that the CUDA kernels serve (SmolLM2-135M, decode-faithful
perplexity, prefix 1024, 1024 scored tokens, 3 rotation seeds; docs/quality.md): TQ4 with a 128-token exact window
and norm correction +1.47%; adding 4 exact sink tokens and key centring +0.53%; value centring +0.48% (on for 4-bit
values only: at 3 and 2.5 bits it measured worse); tokens leaving the window in blocks of 64 +0.43%. The 3- and
2.5-bit presets add a longer exact window (PRESET_WINDOWS): +1.19% at 4.53x and +3.76% at 5.51x compression at 32K
tokens. Outlier channels measured better still (3.5-bit mode +0.43% at 3.86x) but run on the reference only.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from .backend import BACKENDS
from .codebook import SUPPORTED_BITS
from .rotation import ROTATIONS

ENV_PREFIX = "FLASHQUANT_"
OTHER_ENV_VARS = ("FLASHQUANT_COMMIT",)  # not a cache setting: the commit benchmarks/run_gpu.py names in its results
HALF_BITS = (1.5, 2.5, 3.5)  # mixed classes: keys round up, values round down
# Exact window of a bit class when `residual_length` is not given (else DEFAULT_WINDOW): the low-bit presets spend
# part of their byte budget on recent tokens (docs/quality.md; 3 seeds x 1024 decode-faithful tokens, SmolLM2):
# 3 bits, 512 tokens: +1.22% instead of +2.84% (+0.43% instead of +1.61% after a 4096-token prefix), 4.53x instead
# of 4.73x at 32K tokens; 2.5 bits, 192 tokens: +3.87% instead of +4.26%, 5.51x instead of 5.56x.
PRESET_WINDOWS: dict[int | float, int] = {3: 512, 2.5: 192}
DEFAULT_WINDOW = 128
DEFAULT_WINDOW_BLOCK = 64

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_bits(text: str) -> int | float:
    value = float(text.strip())
    return int(value) if value.is_integer() else value


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {_TRUE + _FALSE}")


def _parse_str(text: str) -> str:
    return text.strip().lower()


@dataclass(frozen=True)
class TurboQuantConfig:
    """Settings of a :class:`~flashquant_hf.TurboQuantCache`.

    Every field left as ``None`` is read from its ``FLASHQUANT_<FIELD>`` environment variable (e.g.
    ``FLASHQUANT_BITS=3``), else takes the default below. After construction every field holds a concrete value.
    A ``FLASHQUANT_<FIELD>`` value that cannot be parsed raises a ValueError even when an argument overrides it; a
    ``FLASHQUANT_*`` variable that names no field is warned about (it would otherwise be ignored silently).

    Parameters
    ----------
    bits : bits per coordinate for keys and values (1..4; default 4), or a half-bit class 1.5 / 2.5 / 3.5, which
        gives keys one bit more than values (2.5 -> keys 3, values 2: keys are the more sensitive tensor)
    key_bits, value_bits : per-tensor overrides of ``bits`` (default: derived from ``bits``)
    residual_length : the newest tokens kept exact in the model dtype (default 128; 512 for ``bits=3``, 192 for
        ``bits=2.5``); 0 (with ``sink_tokens=0``) compresses every token before it is attended
    window_block : tokens leaving the exact window are compressed this many at a time, so the window holds
        ``residual_length`` to ``residual_length + window_block - 1`` tokens (default 64; 1 when
        ``residual_length=0``, which keeps "every token compressed before it is attended"). Compression then runs
        once per block instead of every decode step (the end-to-end decode speed against DynamicCache:
        ``e2e_decode_tokens_per_s_ratio_32k`` in benchmarks/results.json).
    sink_tokens : the first tokens of the sequence kept exact forever (default 4)
    key_centering, value_centering : subtract a per-sequence, per-head, per-channel mean (computed on the first
        prefill) before compressing; exact for attention (default: keys always, values when ``value_bits == 4``)
    norm_correction : store ``||x|| / ||centroids[idx]||`` so reconstructions keep the exact norm (default True)
    outlier_channels : channels of each KV head coded with one bit more (keys and values; the paper's mixed-
        precision modes), chosen per sequence and head by their mean square on the first prefill (default 0:
        off; needs codes of <= 3 bits: ``value_bits`` <= 3, ``key_bits`` <= 3, or <= 4 with ``key_qjl``). Runs on
        the PyTorch reference path.
    key_qjl : keys as a ``key_bits - 1``-bit MSE code plus a 1-bit QJL sketch of the residual (TurboQuant_prod:
        unbiased scores; default False; needs ``key_bits`` >= 2). Runs on the PyTorch reference path.
    rotation : ``"haar"`` (dense random orthogonal) or ``"hadamard"`` (randomized Hadamard; power-of-two head_dim)
    seed : rotation seed; keys use ``2 * seed``, values ``2 * seed + 1`` (default 0)
    backend : ``"auto"``, ``"cuda"`` or ``"torch"`` (default: ``FLASHQUANT_BACKEND``, else ``auto``)

    >>> TurboQuantConfig(bits=3).key_bits
    3
    >>> TurboQuantConfig(key_bits=4, value_bits=2).bits
    4
    >>> TurboQuantConfig(bits=2.5).key_bits, TurboQuantConfig(bits=2.5).value_bits
    (3, 2)
    """

    bits: int | float | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    residual_length: int | None = None
    window_block: int | None = None
    sink_tokens: int | None = None
    key_centering: bool | None = None
    value_centering: bool | None = None
    norm_correction: bool | None = None
    outlier_channels: int | None = None
    key_qjl: bool | None = None
    rotation: Literal["haar", "hadamard"] | None = None
    seed: int | None = None
    backend: Literal["auto", "cuda", "torch"] | None = None
    # Fields that took a value derived from others (bits -> key/value bits, window, value centring); replace()
    # derives them again from the new settings instead of keeping the old derived value.
    _derived: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = field_names()
        check_environment()
        from_env = {name for name in names if getattr(self, name) is None and os.environ.get(env_var(name), "").strip()}
        resolved = {name: _resolve(name, getattr(self, name)) for name in names}
        object.__setattr__(self, "_derived", frozenset(name for name, value in resolved.items() if value is None))
        bits = resolved["bits"]
        if bits in HALF_BITS:
            derived = (int(bits + 0.5), int(bits - 0.5))
        else:
            derived = (bits, bits)
        for name, value in zip(("key_bits", "value_bits"), derived):
            if resolved[name] is None:
                resolved[name] = value
        if resolved["value_centering"] is None:
            # Measured (docs/quality.md): within noise of helping at 4 bits, +0.2 / +0.7 points at 3 / 2.5 bits.
            resolved["value_centering"] = resolved["value_bits"] == 4
        if resolved["residual_length"] is None:
            resolved["residual_length"] = PRESET_WINDOWS.get(bits, DEFAULT_WINDOW)
        if resolved["window_block"] is None:
            resolved["window_block"] = DEFAULT_WINDOW_BLOCK if resolved["residual_length"] else 1
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        problem = self._first_problem()
        if problem is not None:
            name, expected = problem
            source = f" (from the environment variable `{env_var(name)}`)" if name in from_env else ""
            raise ValueError(f"`{name}` must be {expected}, got {getattr(self, name)!r}{source}")

    def _first_problem(self) -> tuple[str, str] | None:
        """(field, what it must be) of the first invalid field, or None."""
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS + HALF_BITS:
            return "bits", f"one of {SUPPORTED_BITS + HALF_BITS}"
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in SUPPORTED_BITS:
                return name, f"one of {SUPPORTED_BITS}"
        for name in ("residual_length", "sink_tokens", "seed", "outlier_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return name, "an integer >= 0"
        if isinstance(self.window_block, bool) or not isinstance(self.window_block, int) or self.window_block < 1:
            return "window_block", "an integer >= 1"
        for name in ("key_centering", "value_centering", "norm_correction", "key_qjl"):
            if not isinstance(getattr(self, name), bool):
                return name, "True or False"
        if self.key_qjl and self.key_bits < 2:
            return "key_bits", ">= 2 with `key_qjl` (one bit goes to the residual sketch)"
        if self.outlier_channels:  # outlier channels take one bit more than the code, and codes have at most 4
            if (self.key_bits - 1 if self.key_qjl else self.key_bits) > 3:
                return "key_bits", "<= 3 with `outlier_channels` (<= 4 with `key_qjl` too)"
            if self.value_bits > 3:
                return "value_bits", "<= 3 with `outlier_channels`"
        if self.rotation not in ROTATIONS:
            return "rotation", f"one of {ROTATIONS}"
        if self.backend not in BACKENDS:
            return "backend", f"one of {BACKENDS}"
        return None

    @property
    def key_seed(self) -> int:
        """Seed of the key rotation."""
        return 2 * self.seed

    @property
    def value_seed(self) -> int:
        """Seed of the value rotation."""
        return 2 * self.seed + 1

    def replace(self, **overrides: Any) -> "TurboQuantConfig":
        """A copy with ``overrides`` applied (unknown names raise TypeError)."""
        unknown = sorted(set(overrides) - set(field_names()))
        if unknown:
            raise TypeError(f"unknown TurboQuantConfig field(s) {unknown}; fields are {field_names()}")
        values = {name: getattr(self, name) for name in field_names()}
        # Derived fields are derived again; key/value bits also follow a new `bits` when they were set.
        for name in self._derived | ({"key_bits", "value_bits"} if "bits" in overrides else set()):
            values[name] = None
        values.update(overrides)
        return TurboQuantConfig(**values)


# name -> (parser, default). `None` defaults are derived in __post_init__.
_FIELDS: dict[str, tuple[Callable[[str], Any], Any]] = {
    "bits": (_parse_bits, 4),
    "key_bits": (_parse_int, None),
    "value_bits": (_parse_int, None),
    "residual_length": (_parse_int, None),
    "window_block": (_parse_int, None),
    "sink_tokens": (_parse_int, 4),
    "key_centering": (_parse_bool, True),
    "value_centering": (_parse_bool, None),
    "norm_correction": (_parse_bool, True),
    "outlier_channels": (_parse_int, 0),
    "key_qjl": (_parse_bool, False),
    "rotation": (_parse_str, "haar"),
    "seed": (_parse_int, 0),
    "backend": (_parse_str, "auto"),
}


def env_var(name: str) -> str:
    """The environment variable that sets field ``name`` (``bits`` -> ``FLASHQUANT_BITS``)."""
    return ENV_PREFIX + name.upper()


def field_names() -> list[str]:
    """Names of the TurboQuantConfig fields, in declaration order."""
    return [f.name for f in dataclasses.fields(TurboQuantConfig) if f.init]


def check_environment() -> None:
    """Check every ``FLASHQUANT_*`` variable set: ValueError for a value its field cannot parse, a warning for a
    name that is no field (a misspelt variable would otherwise be ignored silently)."""
    for var, text in sorted(os.environ.items()):
        if not var.startswith(ENV_PREFIX) or var in OTHER_ENV_VARS or not text.strip():
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in _FIELDS:
            _parse_env(name, text)
        else:
            warnings.warn(
                f"environment variable `{var}` is not a flashquant setting and is ignored; the settings are "
                f"{[env_var(field) for field in _FIELDS]}",
                UserWarning,
                stacklevel=4,
            )


def _parse_env(name: str, text: str) -> Any:
    parse, _ = _FIELDS[name]
    try:
        return parse(text)
    except ValueError as error:
        raise ValueError(f"environment variable `{env_var(name)}`={text!r} is invalid: {error}") from None


def _resolve(name: str, value: Any) -> Any:
    if value is not None:
        return value
    text = os.environ.get(env_var(name))
    if text is None or not text.strip():
        return _FIELDS[name][1]
    return _parse_env(name, text)
