"""TurboQuantConfig: defaults, FLASHQUANT_* environment variables, precedence, validation, the docs table."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from flashquant_hf import TurboQuantConfig
from flashquant_hf.config import env_var, field_names

DOC = Path(__file__).resolve().parent.parent / "README.md"  # the one settings table


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in field_names():
        monkeypatch.delenv(env_var(name), raising=False)


def test_defaults_are_the_measured_best():
    cfg = TurboQuantConfig()
    assert (cfg.bits, cfg.key_bits, cfg.value_bits) == (4, 4, 4)
    assert cfg.residual_length == 128
    assert cfg.norm_correction is True
    assert (cfg.sink_tokens, cfg.key_centering, cfg.value_centering) == (4, True, True)
    assert (cfg.rotation, cfg.seed, cfg.backend) == ("haar", 0, "auto")
    assert (cfg.key_seed, cfg.value_seed) == (0, 1)


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("bits", "3", 3),
        ("bits", "2.5", 2.5),
        ("key_bits", "2", 2),
        ("value_bits", "1", 1),
        ("residual_length", "0", 0),
        ("sink_tokens", "4", 4),
        ("key_centering", "true", True),
        ("value_centering", "1", True),
        ("norm_correction", "off", False),
        ("rotation", "Hadamard", "hadamard"),
        ("seed", "7", 7),
        ("backend", "torch", "torch"),
    ],
)
def test_every_field_reads_its_environment_variable(monkeypatch, name, text, expected):
    monkeypatch.setenv(env_var(name), text)
    assert getattr(TurboQuantConfig(), name) == expected


def test_explicit_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BITS", "2")
    monkeypatch.setenv("FLASHQUANT_RESIDUAL_LENGTH", "5")
    cfg = TurboQuantConfig(bits=3)
    assert (cfg.bits, cfg.key_bits, cfg.value_bits, cfg.residual_length) == (3, 3, 3, 5)


def test_key_and_value_bits_follow_bits_unless_set():
    cfg = TurboQuantConfig(bits=2, value_bits=4)
    assert (cfg.key_bits, cfg.value_bits) == (2, 4)
    again = cfg.replace(bits=3)
    assert (again.key_bits, again.value_bits) == (3, 3)
    assert cfg.replace(residual_length=0).value_bits == 4


def test_value_centring_defaults_to_4_bit_values_only(monkeypatch):
    assert TurboQuantConfig().value_centering is True
    assert TurboQuantConfig(bits=3).value_centering is False
    assert TurboQuantConfig(bits=2.5).value_centering is False
    assert TurboQuantConfig(bits=3, value_bits=4).value_centering is True
    assert TurboQuantConfig(bits=3, value_centering=True).value_centering is True
    assert TurboQuantConfig().replace(bits=3).value_centering is False
    monkeypatch.setenv("FLASHQUANT_VALUE_CENTERING", "1")
    assert TurboQuantConfig(bits=3).value_centering is True


def test_window_follows_the_bit_class_unless_set(monkeypatch):
    assert TurboQuantConfig().residual_length == 128
    assert TurboQuantConfig(bits=3).residual_length == 512
    assert TurboQuantConfig(bits=2.5).residual_length == 192
    assert TurboQuantConfig(bits=2).residual_length == 128
    assert TurboQuantConfig(bits=3, residual_length=64).residual_length == 64
    # replace() derives a derived window again, and keeps one that was set
    assert TurboQuantConfig().replace(bits=3).residual_length == 512
    assert TurboQuantConfig(bits=3).replace(bits=4).residual_length == 128
    assert TurboQuantConfig(residual_length=0, sink_tokens=0).replace(bits=3).residual_length == 0
    monkeypatch.setenv("FLASHQUANT_RESIDUAL_LENGTH", "7")
    assert TurboQuantConfig(bits=3).residual_length == 7


def test_replace_keeps_explicit_value_centring():
    assert TurboQuantConfig(value_centering=True).replace(bits=3).value_centering is True
    assert TurboQuantConfig(bits=3).replace(value_bits=4).value_centering is True


@pytest.mark.parametrize("bits, key_bits, value_bits", [(1.5, 2, 1), (2.5, 3, 2), (3.5, 4, 3)])
def test_half_bit_classes_give_keys_one_bit_more(bits, key_bits, value_bits):
    cfg = TurboQuantConfig(bits=bits)
    assert (cfg.bits, cfg.key_bits, cfg.value_bits) == (bits, key_bits, value_bits)
    assert TurboQuantConfig(bits=bits, value_bits=key_bits).value_bits == key_bits
    assert cfg.replace(bits=4).key_bits == cfg.replace(bits=4).value_bits == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"bits": 5}, "bits"),
        ({"bits": 2.7}, "bits"),
        ({"bits": 4.5}, "bits"),
        ({"key_bits": 0}, "key_bits"),
        ({"value_bits": True}, "value_bits"),
        ({"residual_length": -1}, "residual_length"),
        ({"sink_tokens": 1.5}, "sink_tokens"),
        ({"key_centering": 1}, "key_centering"),
        ({"rotation": "dct"}, "rotation"),
        ({"backend": "tpu"}, "backend"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        TurboQuantConfig(**kwargs)


def test_invalid_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BITS", "five")
    with pytest.raises(ValueError, match="FLASHQUANT_BITS"):
        TurboQuantConfig()
    monkeypatch.setenv("FLASHQUANT_BITS", "9")
    with pytest.raises(ValueError, match="FLASHQUANT_BITS"):
        TurboQuantConfig()


def test_replace_rejects_unknown_fields():
    with pytest.raises(TypeError, match="nbits"):
        TurboQuantConfig().replace(nbits=3)


def test_config_is_a_frozen_dataclass():
    cfg = TurboQuantConfig(bits=3)
    assert dataclasses.asdict(cfg)["value_bits"] == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 2
    assert cfg == TurboQuantConfig(bits=3)


def test_docs_table_lists_every_field_and_variable():
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    documented = {m.group(1): row for row in rows if (m := re.match(r"\| `(\w+)` \|", row))}
    for name in field_names():
        assert name in documented, f"the README settings table has no row for `{name}`"
        assert env_var(name) in documented[name], f"the row of `{name}` does not name {env_var(name)}"


def test_invalid_environment_value_is_an_error_even_where_an_argument_overrides_it(monkeypatch):
    monkeypatch.setenv("FLASHQUANT_BITS", "abc")
    with pytest.raises(ValueError, match="environment variable `FLASHQUANT_BITS`='abc' is invalid"):
        TurboQuantConfig(bits=4)


def test_unknown_environment_variable_is_warned_about(monkeypatch):
    expected = TurboQuantConfig()
    monkeypatch.setenv("FLASHQUANT_FOO", "1")
    with pytest.warns(UserWarning, match=r"`FLASHQUANT_FOO` is not a flashquant setting.*FLASHQUANT_BITS"):
        assert TurboQuantConfig() == expected
    monkeypatch.delenv("FLASHQUANT_FOO")
    monkeypatch.setenv("FLASHQUANT_COMMIT", "abc1234")  # the benchmarks' variable: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TurboQuantConfig()


def test_unknown_cache_setting_names_the_cache_and_lists_the_fields():
    from flashquant_hf import TurboQuantCache

    for args in ((), (TurboQuantConfig(),)):
        with pytest.raises(TypeError) as info:
            TurboQuantCache(*args, foo=1)
        message = str(info.value)
        assert message.startswith("TurboQuantCache() got unknown setting(s) ['foo']")
        assert all(f"'{name}'" in message for name in field_names())


def test_string_fields_are_typed_with_the_values_they_accept():
    """The Literal types of `rotation` and `backend` list exactly what validation accepts."""
    import typing

    from flashquant_hf.backend import BACKENDS
    from flashquant_hf.rotation import ROTATIONS

    hints = typing.get_type_hints(TurboQuantConfig)
    for name, allowed in (("rotation", ROTATIONS), ("backend", BACKENDS)):
        literal, none = typing.get_args(hints[name])
        assert none is type(None) and typing.get_args(literal) == allowed, name
