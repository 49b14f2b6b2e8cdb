"""One command for the GPU machine: every GPU test, then every benchmark; prints a table.

    python benchmarks/run_gpu.py [--only NAME ...] [--skip-tests] [--out DIR]

Writes the run's record ``benchmarks/runs/<date>_run<NN>_<commit>.json`` ({"run", "date", "commit", "gpu",
"command", "tests", "note", "results"}), updates ``benchmarks/results.json`` (the newest value of every metric: a
list of {"name", "value", "unit", "target", "commit", "date"}) and regenerates ``benchmarks/RESULTS.md`` from both
(``benchmarks/render_results.py``). When ``$OUT`` or ``--out`` is set, copies of the three files and the test log
go there too. Each ``benchmarks/bench_*.py`` module and ``benchmarks/e2e_compiled.py`` expose ``run(record)``; a
failing benchmark is reported and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import render_results  # noqa: E402


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
    summary = next((line.strip("= ") for line in reversed(log.splitlines()) if " passed" in line or " failed" in line),
                   "no summary")
    return proc.returncode, summary


def run_benchmarks(only: list[str] | None, save=None) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    commit, date = _commit(), datetime.date.today().isoformat()
    results: list[dict] = []

    def record(name: str, value: float, unit: str, target: str | None = None) -> None:
        entry = {"name": name, "value": float(value), "unit": unit, "target": target, "commit": commit, "date": date}
        results.append(entry)
        print(f"  {name:<44} {value:>12.4g} {unit:<10} {target or ''}", flush=True)

    for path in sorted(HERE.glob("bench_*.py")) + [HERE / "e2e_compiled.py"]:
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


def _command(args: argparse.Namespace) -> str:
    """The command line of this run as recorded in its run file (without ``--out``: where copies went)."""
    words = ["python", "benchmarks/run_gpu.py"]
    if args.skip_tests:
        words.append("--skip-tests")
    if args.workers:
        words += ["--workers", str(args.workers)]
    if args.only is not None:
        words += ["--only", *args.only]
    return shlex.join(words)


def run_record(number: int, results: list[dict], gpu: str, command: str, test_summary: str) -> dict:
    """The run's file content (``benchmarks/runs/``); ``note`` is left for whoever reads the run."""
    commit = results[0]["commit"] if results else _commit()
    date = results[0]["date"] if results else datetime.date.today().isoformat()
    rows = [{key: r[key] for key in render_results.RESULT_KEYS} for r in results]
    return {"run": number, "date": date, "commit": commit, "gpu": gpu, "command": command, "tests": test_summary,
            "note": "", "results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only benchmarks whose module name contains one of these")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for the GPU tests")
    args = parser.parse_args(argv)
    command = _command(args)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    test_rc, summary = (0, "not run") if args.skip_tests else run_tests(out_dir, args.workers)

    number = render_results.next_run_number()
    previous = render_results.load_latest()

    def save(results: list[dict]) -> None:
        record = run_record(number, results, torch.cuda.get_device_name(), command, summary)
        latest = render_results.merge_latest(previous, results)
        run_path = render_results.RUNS_DIR / render_results.run_file_name(record)
        render_results.RUNS_DIR.mkdir(exist_ok=True)
        run_path.write_text(json.dumps(record, indent=1) + "\n")
        render_results.RESULTS_JSON.write_text(json.dumps(latest, indent=1))
        markdown = render_results.render(latest, render_results.load_runs())
        render_results.RESULTS_MD.write_text(markdown)
        if out_dir:
            (out_dir / "runs").mkdir(exist_ok=True)
            (out_dir / "runs" / run_path.name).write_text(run_path.read_text())
            (out_dir / "results.json").write_text(render_results.RESULTS_JSON.read_text())
            (out_dir / "RESULTS.md").write_text(markdown)

    results = run_benchmarks(args.only, save)
    save(results)
    print(f"\n{'name':<44} {'value':>12} unit       target")
    for r in results:
        print(f"{r['name']:<44} {r['value']:>12.4g} {r['unit']:<10} {r['target'] or ''}")
    print(f"GPU tests exit code: {test_rc}")
    return test_rc


if __name__ == "__main__":
    sys.exit(main())
