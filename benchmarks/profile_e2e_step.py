"""Where an eager decode step of bench_e2e's model goes, per TurboQuantCache preset (TQ4, ``bits=3``, ``bits=2.5``).

    python benchmarks/profile_e2e_step.py [--layers N] [--out DIR]

The Llama-3-8B-shaped model of ``bench_e2e`` (``--layers`` decoder layers, default 32), every cache prefilled with
the same random B=8 x 32K prompts, then decode steps of the caches in turn (``PASSES`` passes of ``STEPS`` steps,
the first ``WARMUP`` of each pass untimed). Per preset, medians over the timed steps:

- ``host_ms``: from the call of the model until it returns (the host's work: Python, transformers, the launches);
- ``step_ms``: until the GPU has finished the step as well;
- ``device_busy_ms``: the GPU's kernel time of one step (torch.profiler, summed over kernels).

A step whose ``host_ms`` is close to ``step_ms`` and well above ``device_busy_ms`` is host-bound: the kernels' speed
does not reach the tokens/s. Writes ``e2e_step/<date>_<commit>.json`` under ``--out`` (default: ``benchmarks/``),
with the ops that take the most host and device time per preset.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_e2e import BATCH, CONTEXT, LLAMA3_8B, _cache_kwargs, build_model, prefill  # noqa: E402
from benchmarks.run_gpu import _commit  # noqa: E402

PRESETS = {"bits4": {}, "bits3": {"bits": 3}, "bits2p5": {"bits": 2.5}}
PASSES = 5
STEPS = 12
WARMUP = 2
PROFILED_STEPS = 3
TOP_OPS = 15


@torch.inference_mode()
def decode_step(model, case: dict) -> tuple[float, float]:
    """One greedy decode step of a prefilled case: (host seconds until the model returns, seconds until the GPU is
    done)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model(case["next_ids"], **_cache_kwargs(model, case["cache"]))
    host = time.perf_counter() - start
    case["next_ids"] = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return host, time.perf_counter() - start


def top_ops(averages, key: str) -> list[dict]:
    rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:TOP_OPS]
    return [{"op": e.key, "calls_per_step": e.count / PROFILED_STEPS,
             "self_host_us_per_step": e.self_cpu_time_total / PROFILED_STEPS,
             "self_device_us_per_step": e.self_device_time_total / PROFILED_STEPS} for e in rows]


def device_profile(model, case: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            decode_step(model, case)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type != torch.autograd.DeviceType.CPU]  # not the ops that launch them
    return {
        "device_busy_ms": sum(e.self_device_time_total for e in kernels) / PROFILED_STEPS / 1e3,
        "top_host_ops": top_ops(averages, "self_cpu_time_total"),
        "top_device_ops": top_ops(averages, "self_device_time_total"),
    }


def profile_presets(layers: int) -> dict:
    from flashquant_hf import TurboQuantCache

    model = build_model(layers)
    generator = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, LLAMA3_8B["vocab_size"], (BATCH, CONTEXT), device="cuda", generator=generator)
    cases = {}
    for name, settings in PRESETS.items():
        cache, next_ids, _ = prefill(model, lambda: TurboQuantCache(**settings), input_ids)
        cases[name] = {"cache": cache, "next_ids": next_ids, "host": [], "step": []}
    for _ in range(PASSES):  # the caches in turn, so the host's drift reaches each alike
        for case in cases.values():
            for i in range(STEPS):
                host, step = decode_step(model, case)
                if i >= WARMUP:
                    case["host"].append(host)
                    case["step"].append(step)
    figures = {}
    for name, case in cases.items():
        figures[name] = {"host_ms": statistics.median(case["host"]) * 1e3,
                         "step_ms": statistics.median(case["step"]) * 1e3, **device_profile(model, case)}
        print(f"{name}: host {figures[name]['host_ms']:.2f} ms, step {figures[name]['step_ms']:.2f} ms, device busy "
              f"{figures[name]['device_busy_ms']:.2f} ms per step", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    commit = _commit()
    doc = {"date": datetime.date.today().isoformat(), "commit": commit, "gpu": torch.cuda.get_device_name(),
           "command": f"python benchmarks/profile_e2e_step.py --layers {args.layers}",  # not --out: where it went
           "batch": BATCH, "context": CONTEXT, "layers": args.layers, "presets": profile_presets(args.layers)}
    path = Path(args.out) / "e2e_step" / f"{doc['date']}_{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
