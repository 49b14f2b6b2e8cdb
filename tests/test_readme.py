"""The README's quickstart runs as shown: the snippet between its quickstart markers, extracted and executed."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


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
