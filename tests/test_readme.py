"""The README's quickstart runs as shown (the snippet between its quickstart markers, extracted and executed),
and its Layout table names every module of the package."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
PACKAGE = README.parent / "flashquant_hf"


def quickstart_snippet() -> str:
    """The Python block between ``<!-- quickstart -->`` and ``<!-- /quickstart -->`` of README.md."""
    text = README.read_text()
    block = re.search(r"<!-- quickstart -->\s*```python\n(.*?)```\s*<!-- /quickstart -->", text, re.S)
    assert block, "README.md has no ```python block between <!-- quickstart --> and <!-- /quickstart -->"
    return block.group(1)


@pytest.mark.slow
def test_quickstart_runs_as_shown():
    from flashquant_hf import TurboQuantCache

    namespace: dict = {"__name__": "__readme__"}
    stdout = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(stdout):
        warnings.simplefilter("always")
        exec(compile(quickstart_snippet(), str(README), "exec"), namespace)
    cache, out, inputs = namespace["cache"], namespace["out"], namespace["inputs"]
    prompt = inputs["input_ids"].shape[1]
    assert isinstance(cache, TurboQuantCache) and out.shape[1] > prompt
    assert cache.get_seq_length() == out.shape[1] - 1  # the last generated token is never fed back
    answer, layer, sizes = stdout.getvalue().strip().splitlines()
    assert "paris" in answer.lower(), answer
    assert layer.startswith("TurboQuantLayer(layer_idx=0") and "bytes allocated" in sizes
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


def layout_paths() -> list[str]:
    """The paths named in the first column of the README's Layout table, relative to ``flashquant_hf/`` (a bare
    ``name.py`` beside a ``flashquant_hf/...`` path is in the package too), folders without their ``/``."""
    section = README.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [name.removeprefix("flashquant_hf/").rstrip("/") for row in rows for name in re.findall(r"`([^`]+)`", row)]


def test_layout_table_names_every_module_once():
    modules = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    named = layout_paths()
    assert [m for m in modules if m not in named] == [], "modules missing from README's Layout table"
    assert sorted(m for m in named if m in modules) == modules, "a module named twice in README's Layout table"
