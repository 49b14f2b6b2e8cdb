"""On a GPU machine: ``generate()`` through an installed (non-editable) flashquant-hf runs the CUDA kernels the
wheel ships, for the TQ4, bits=3 and bits=2.5 presets, with no fallback to the PyTorch reference.

    pip wheel --no-deps -w dist .                                   # here, or take the wheel CI builds
    pip install --no-deps --target /tmp/site-packages dist/flashquant_hf-*.whl
    cd /tmp && PYTHONPATH=/tmp/site-packages python /path/to/tools/check_installed_wheel_gpu.py [--json OUT]

Exit status 0 when the package is imported from the install (not a checkout), every layer decided on the CUDA
backend, kernels were compiled from the installed sources, tokens were compressed, and nothing was logged or
warned about the reference. Prints the findings as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the findings to this file")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import flashquant_hf
    from flashquant_hf import TurboQuantCache
    from flashquant_hf.cache import cache_kwargs
    from flashquant_hf.kernels import loader

    log = _Collect()
    logging.getLogger("flashquant_hf").addHandler(log)
    logging.getLogger("flashquant_hf").setLevel(logging.INFO)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    # Longer than the widest exact window (512 tokens for bits=3) plus a window block, so every preset compresses.
    input_ids = torch.randint(0, config.vocab_size, (2, 800), generator=generator).cuda()
    findings: dict = {"package": flashquant_hf.__file__, "kernel_sources": str(loader.CUDA_DIR), "presets": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bits in (4, 3, 2.5):
            cache = TurboQuantCache(bits=bits)
            out = model.generate(input_ids, **cache_kwargs(model, cache), max_new_tokens=8, do_sample=False)
            layers = [layer for layer in cache.layers if getattr(layer, "backend", None) is not None]
            findings["presets"][str(bits)] = {
                "new_tokens": out.shape[1] - input_ids.shape[1],
                "backends": sorted({layer.backend for layer in layers}),
                "compressed_tokens": min(int(layer.num_compressed) for layer in layers),
            }
    findings["compiled_kernels"] = loader._kernel.cache_info().currsize
    findings["warnings"] = [str(w.message) for w in caught]
    findings["log"] = log.messages
    installed = "site-packages" in flashquant_hf.__file__ and "site-packages" in findings["kernel_sources"]
    presets_ok = all(p["backends"] == ["cuda"] and p["compressed_tokens"] > 0 for p in findings["presets"].values())
    fallback = [m for m in findings["log"] + findings["warnings"] if "reference" in m]
    findings["ok"] = installed and presets_ok and findings["compiled_kernels"] > 0 and not fallback
    text = json.dumps(findings, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if findings["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
