"""One command for the GPU machine: every GPU test, then every benchmark; prints a table.

    python benchmarks/run_gpu.py [--only NAME ...] [--skip-tests] [--out DIR]

Writes ``benchmarks/results.json`` (a list of {"name", "value", "unit", "target", "commit", "date"}) and,
when ``$OUT`` or ``--out`` is set, copies of it and of the logs there. Each ``benchmarks/bench_*.py`` module
exposes ``run(record)``; a failing benchmark is reported and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _commit() -> str:
    if os.environ.get("FLASHQUANT_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["FLASHQUANT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def run_tests(out_dir: Path | None, workers: int = 0) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "tests/gpu"]
    if workers > 1:  # pytest-xdist: NVRTC compilation and the tests spread over CPU cores, one GPU shared
        cmd += ["-n", str(workers)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if out_dir:
        (out_dir / "gpu_tests.log").write_text(log)
    print("\n".join(log.splitlines()[-40:]))
    summary = next((line.strip("= ") for line in reversed(log.splitlines()) if " passed" in line or " failed" in line), "no summary")
    return proc.returncode, summary


def run_benchmarks(only: list[str] | None, save=None) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    commit, date = _commit(), datetime.date.today().isoformat()
    results: list[dict] = []

    def record(name: str, value: float, unit: str, target: str | None = None) -> None:
        entry = {"name": name, "value": float(value), "unit": unit, "target": target, "commit": commit, "date": date}
        results.append(entry)
        print(f"  {name:<44} {value:>12.4g} {unit:<10} {target or ''}", flush=True)

    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem
        if only and not any(o in name for o in only):
            continue
        print(f"== {name}", flush=True)
        try:
            importlib.import_module(f"benchmarks.{name}").run(record)
        except Exception:
            traceback.print_exc()
            record(f"{name}_failed", 1, "error")
        if save is not None:  # after every module, so a run cut short by a time limit keeps what it measured
            save(results)
    return results


def render_markdown(results: list[dict], gpu: str, test_summary: str) -> str:
    """A RESULTS.md section: date, commit, GPU, and one table row per measurement."""
    commit = results[0]["commit"] if results else _commit()
    date = results[0]["date"] if results else datetime.date.today().isoformat()
    lines = [f"## {date} · commit {commit} · {gpu}", "", f"GPU tests: {test_summary}", "",
             "| name | value | unit | target |", "|---|---:|---|---|"]
    lines += [f"| {r['name']} | {r['value']:.4g} | {r['unit']} | {r['target'] or ''} |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only benchmarks whose module name contains one of these")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for the GPU tests")
    args = parser.parse_args(argv)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    test_rc, summary = (0, "not run") if args.skip_tests else run_tests(out_dir, args.workers)

    def save(results: list[dict]) -> None:
        text = json.dumps(results, indent=1)
        (HERE / "results.json").write_text(text)
        if out_dir:
            (out_dir / "results.json").write_text(text)
            (out_dir / "RESULTS_section.md").write_text(render_markdown(results, torch.cuda.get_device_name(), summary))

    results = run_benchmarks(args.only, save)
    save(results)
    print(f"\n{'name':<44} {'value':>12} unit       target")
    for r in results:
        print(f"{r['name']:<44} {r['value']:>12.4g} {r['unit']:<10} {r['target'] or ''}")
    print(f"GPU tests exit code: {test_rc}")
    return test_rc


if __name__ == "__main__":
    sys.exit(main())
