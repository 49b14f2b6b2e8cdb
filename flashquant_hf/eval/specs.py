"""Cache configurations to evaluate: named presets plus ``key=value`` overrides of TurboQuantConfig fields.

A spec is a comma-separated list: at most one preset name (first), then ``field=value`` items, and an optional
``name=LABEL`` for the table. Examples: ``tq4``, ``tq3,residual_length=0``, ``bits=4,residual_length=0``,
``key_bits=4,value_bits=3,name=k4v3``. Fields not given keep TurboQuantConfig's defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from .errors import EvalInputError

DYNAMIC = "dynamic"

PRESETS: dict[str, dict[str, Any]] = {
    "tq4": {"bits": 4},
    "tq3": {"bits": 3},
    "tq2": {"bits": 2},
    "tq3.5": {"bits": 3.5},
    "tq2.5": {"bits": 2.5},
    # "-r0": every token compressed (no exact window, no exact sinks)
    "tq4-r0": {"bits": 4, "residual_length": 0, "sink_tokens": 0},
    "tq3-r0": {"bits": 3, "residual_length": 0, "sink_tokens": 0},
    "tq2-r0": {"bits": 2, "residual_length": 0, "sink_tokens": 0},
    "k4v3": {"key_bits": 4, "value_bits": 3},
    "k4v2": {"key_bits": 4, "value_bits": 2},
}


@dataclass(frozen=True)
class CacheSpec:
    """One row of the evaluation: a display name and the TurboQuantConfig overrides (None = DynamicCache)."""

    name: str
    overrides: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def is_dynamic(self) -> bool:
        """Whether this row is the DynamicCache baseline."""
        return self.overrides is None


def turboquant_api():
    """(TurboQuantConfig, TurboQuantCache) from flashquant_hf; EvalInputError when this build lacks them."""
    try:
        from flashquant_hf import TurboQuantCache, TurboQuantConfig
    except ImportError as err:
        raise EvalInputError(
            f"TurboQuantCache is not available in this installation of flashquant_hf ({err})"
        ) from None
    return TurboQuantConfig, TurboQuantCache


def config_fields() -> tuple[str, ...]:
    """Names of the TurboQuantConfig fields a spec may set."""
    config_cls, _ = turboquant_api()
    if dataclasses.is_dataclass(config_cls):
        return tuple(f.name for f in dataclasses.fields(config_cls) if f.init)
    params = inspect.signature(config_cls).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def parse_value(text: str) -> Any:
    """``"4"`` -> 4, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, ``"none"`` -> None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_cache_spec(text: str) -> CacheSpec:
    """Parse one ``--config`` value into a CacheSpec and check it by building a TurboQuantConfig.

    >>> parse_cache_spec("tq3,residual_length=0").overrides  # doctest: +SKIP
    {'bits': 3, 'residual_length': 0}
    """
    if not isinstance(text, str) or not text.strip():
        raise EvalInputError(f"`--config` must be a preset or key=value list, got {text!r}")
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise EvalInputError(f"`--config` {text!r} has an empty item (stray comma)")
    overrides: dict[str, Any] = {}
    name = None
    if "=" not in items[0]:
        preset = items.pop(0).lower()
        if preset == DYNAMIC:
            raise EvalInputError("`--config dynamic` is not needed: DynamicCache is always evaluated as the baseline")
        if preset not in PRESETS:
            raise EvalInputError(f"`--config` preset {preset!r} is unknown; presets are {sorted(PRESETS)}")
        overrides.update(PRESETS[preset])
    allowed = config_fields()
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise EvalInputError(
                f"`--config` {text!r}: {item!r} is not key=value (a preset name may only come first)"
            )
        if key == "name":
            name = value
            continue
        if key not in allowed:
            raise EvalInputError(f"`--config` {text!r}: unknown field {key!r}; fields are {list(allowed)}")
        overrides[key] = parse_value(value)
    name = name or text.strip()
    if name == DYNAMIC:
        raise EvalInputError(f"`--config` {text!r}: the name {DYNAMIC!r} is reserved for the DynamicCache baseline")
    make_config(overrides, spec_text=text)
    return CacheSpec(name=name, overrides=overrides)


def make_config(overrides: dict[str, Any], spec_text: str | None = None, **extra: Any):
    """A TurboQuantConfig from ``overrides`` (and ``extra``, e.g. a seed); its ValueError becomes EvalInputError."""
    config_cls, _ = turboquant_api()
    try:
        return config_cls(**{**overrides, **extra})
    except (TypeError, ValueError) as err:
        where = f"`--config` {spec_text!r}" if spec_text else "cache configuration"
        message = " ".join(str(err).split())
        raise EvalInputError(f"{where}: {message}") from None


def config_as_dict(config) -> dict[str, Any]:
    """The fields of a TurboQuantConfig as a JSON-friendly dict."""
    if dataclasses.is_dataclass(config):
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    else:
        values = {name: getattr(config, name) for name in config_fields() if hasattr(config, name)}
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in values.items()}


def unique_names(specs: list[CacheSpec]) -> None:
    """Raise EvalInputError when two rows would share a name."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise EvalInputError(f"`--config` {spec.name!r} is given twice; add name=LABEL to tell them apart")
        seen.add(spec.name)
