"""The committed notebooks: valid, executed top to bottom, without errors, so they read well on GitHub.

CI executes them separately with nbmake (``pytest --nbmake notebooks/``); this test checks what is committed.
"""

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_quickstart.ipynb", "02_quality_vs_bits.ipynb", "03_kernel_performance.ipynb"}


def test_expected_notebooks_exist():
    assert EXPECTED <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_clean_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code"
    # executed in order, top to bottom, in one kernel session
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), path.name
    for cell in code:
        assert cell.outputs, f"{path.name}: a code cell has no output (commit the executed notebook)"
        for out in cell.outputs:
            assert out.output_type != "error", f"{path.name}: {out.get('ename')}: {out.get('evalue')}"
            text = out.get("text", "")
            assert "Traceback" not in text and "/work/" not in text and "/tmp/" not in text, (path.name, text[:200])
