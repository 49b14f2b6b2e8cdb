"""The package as ``pip install flashquant-hf`` delivers it: a wheel installed (not editable) into site-packages.

``tools/ci_extra.sh`` builds the wheel, installs it into a fresh environment and runs this module from outside
the checkout, together with ``tests/test_cuda_compile.py`` (which then compiles the kernel sources of the
installed package). Where ``flashquant_hf`` is imported from this checkout (``PYTHONPATH``, an editable install)
the module is skipped: there the kernel sources are the checkout's ``cuda/``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
from hf_helpers import one_thread

import flashquant_hf
from flashquant_hf.kernels import loader

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGE = Path(flashquant_hf.__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    PACKAGE.is_relative_to(CHECKOUT),
    reason=f"flashquant_hf is imported from the checkout ({PACKAGE}), not from an installed wheel",
)


def _checkout_files() -> dict[str, Path]:
    """Installed path (relative to site-packages) -> checkout file, for everything the wheel must carry."""
    files = {str(p.relative_to(CHECKOUT)): p for p in (CHECKOUT / "flashquant_hf").rglob("*.py")}
    files["flashquant_hf/py.typed"] = CHECKOUT / "flashquant_hf" / "py.typed"
    for pattern in ("*.cu", "*.cuh", "*.cpp"):
        files.update({f"flashquant_hf/cuda/{p.name}": p for p in (CHECKOUT / "cuda").glob(pattern)})
    return files


def test_wheel_holds_every_module_and_kernel_source_of_the_checkout():
    """Byte for byte, so the suite that ran on the checkout speaks for the installed package."""
    site = PACKAGE.parent
    files = _checkout_files()
    assert any(name.endswith(".cu") for name in files) and any(name.endswith(".cuh") for name in files)
    missing = sorted(name for name in files if not (site / name).is_file())
    assert not missing, f"the wheel lacks {missing}"
    differ = sorted(name for name, path in files.items() if (site / name).read_bytes() != path.read_bytes())
    assert not differ, f"installed files differ from the checkout: {differ}"
    installed = {str(p.relative_to(site)) for p in PACKAGE.rglob("*") if p.is_file() and p.suffix != ".pyc"}
    assert installed == set(files), f"the wheel holds files the checkout does not: {sorted(installed - set(files))}"


def test_distribution_declares_its_license_and_extras():
    meta = importlib.metadata.metadata("flashquant-hf")
    assert meta["License-Expression"] == "Apache-2.0"
    licenses = [f for f in importlib.metadata.files("flashquant-hf") if f.name == "LICENSE"]
    assert len(licenses) == 1
    assert licenses[0].read_text() == (CHECKOUT / "LICENSE").read_text()
    assert "Apache License" in licenses[0].read_text() and "END OF TERMS AND CONDITIONS" in licenses[0].read_text()
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("cupy-cuda13x[ctk]") and 'extra == "cuda"' in r for r in requires), requires
    # The README's main command installs `.[gguf]` only: the embedded model's loader needs nothing else.
    assert [r.split(";")[0].strip() for r in requires if 'extra == "gguf"' in r] == ["gguf>=0.10"], requires


def test_kernel_sources_resolve_through_the_installed_package():
    spec = importlib.util.find_spec("flashquant_hf.cuda")
    assert spec is not None and spec.submodule_search_locations is not None
    assert [Path(p).resolve() for p in spec.submodule_search_locations] == [PACKAGE / "cuda"]
    sources = sorted(p.name for p in (PACKAGE / "cuda").glob("*.cu"))
    assert sources
    for name in sources:
        assert (loader.CUDA_DIR / name).is_file(), name
        text = loader.cuda_source(name)
        assert not re.search(r'^\s*#include\s+"', text, re.MULTILINE), f"{name}: a local include was not inlined"


def test_compress_and_generate_on_smollm2():
    """CPU smoke test: TQ4 round trip within its distortion bound, then greedy generate() of the embedded
    SmolLM2 with every token compressed, whose logits pick DynamicCache's top-1 token at most steps."""
    from pydoc_data.topics import topics
    from transformers import DynamicCache

    from flashquant_hf import TurboQuantCache, TurboQuantizer, lloyd_max_codebook
    from flashquant_hf.models import load_smollm2

    x = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(0))
    quantizer = TurboQuantizer(head_dim=64, bits=4)
    error = ((quantizer.decompress(quantizer.compress(x)) - x).square().sum(-1) / x.square().sum(-1)).mean()
    assert 0 < error.item() < 1.2 * lloyd_max_codebook(64, 4).mse_unit_vector

    model, tokenizer = load_smollm2()
    ids = tokenizer(topics["assert"][:400], return_tensors="pt").input_ids  # CPython's documentation
    steps = 16
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = TurboQuantCache(residual_length=0, sink_tokens=0)
    with one_thread(), torch.inference_mode():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **{key: cache})
        assert out.sequences.shape == (1, ids.shape[1] + steps)
        assert cache.layers[0].num_compressed == ids.shape[1] + steps - 1
        exact = model(out.sequences[:, :-1], use_cache=True, **{key: DynamicCache()}).logits
    expected = exact[0, ids.shape[1] - 1 :].argmax(-1)
    got = torch.stack(out.logits, 1)[0].argmax(-1)
    agreement = (got == expected).float().mean().item()
    print(f"top-1 agreement with DynamicCache over {steps} steps: {agreement:.3f}")
    assert agreement >= 0.75
