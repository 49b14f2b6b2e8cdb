"""benchmarks/RESULTS.md from the result files, and the history of one metric.

    python benchmarks/render_results.py               # rewrite benchmarks/RESULTS.md
    python benchmarks/render_results.py --check       # exit 1 if RESULTS.md differs from what the files give
    python benchmarks/render_results.py --history paged_decode_speedup_b8_n32k
    python benchmarks/render_results.py --run 22      # one run's note and values

Two kinds of file, both written by ``benchmarks/run_gpu.py``:

* ``benchmarks/results.json``: the newest value of every metric, a list of
  ``{"name", "value", "unit", "target", "commit", "date"}``.
* ``benchmarks/runs/<date>_run<NN>_<commit>.json``: one file per run,
  ``{"run", "date", "commit", "gpu", "command", "tests", "note", "results": [{"name", "value", "unit", "target"}]}``.

RESULTS.md is generated: the headline metrics (``HEADLINE``) from results.json with the runs that measured them,
the spread of the baselines over all runs, and the list of runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results.json"
RUNS_DIR = HERE / "runs"
RESULTS_MD = HERE / "RESULTS.md"

RUN_KEYS = {"run": int, "date": str, "commit": str, "gpu": str, "command": str, "tests": str, "note": str,
            "results": list}
RESULT_KEYS = ("name", "value", "unit", "target")
RUN_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})_run(\d+)_([^_/]+)\.json")
# Metrics measured under an earlier name: files keep what was recorded, loading reads them under the current name.
RENAMED = {
    "split_k_reduce_ms_b8_n32k": "merge_partials_ms_b8_n32k",
    "split_k_reduce_fraction_b8_n32k": "merge_partials_fraction_b8_n32k",
}

# (metric, what it measures, (ours, baseline) metrics shown next to the value when the same run measured them)
HEADLINE: tuple[tuple[str, str, tuple[str, str] | None], ...] = (
    ("paged_decode_speedup_b8_n32k",
     "decode attention over a paged TQ4 cache vs SDPA bf16; B=8, N=32K, Hq=32, Hkv=8, D=128",
     ("paged_decode_ms_b8_n32k", "sdpa_decode_ms_b8_n32k")),
    ("paged_decode_hbm_fraction_b8_n32k", "same, fraction of the device copy bandwidth measured in the run", None),
    ("paged_decode_speedup_b1_n128k", "same, B=1, N=128K", ("paged_decode_ms_b1_n128k", "sdpa_decode_ms_b1_n128k")),
    ("paged_decode_speedup_b32_n8k", "same, B=32, N=8K", ("paged_decode_ms_b32_n8k", "sdpa_decode_ms_b32_n8k")),
    ("paged_decode_speedup_k3v3_b8_n32k",
     "paged decode, keys and values 3 bits (104 B/token/head), 20 calls back to back, vs SDPA bf16 timed the same way",
     ("paged_decode_b2b_ms_k3v3_b8_n32k", "sdpa_decode_b2b_ms_b8_n32k")),
    ("paged_decode_hbm_fraction_k3v3_b8_n32k", "same, fraction of the copy bandwidth on the compressed bytes", None),
    ("paged_decode_speedup_k3v2_b8_n32k", "same, keys 3 bits, values 2 (88 B/token/head)",
     ("paged_decode_b2b_ms_k3v2_b8_n32k", "sdpa_decode_b2b_ms_b8_n32k")),
    ("paged_decode_speedup_k2v2_b8_n32k", "same, keys and values 2 bits (72 B/token/head)",
     ("paged_decode_b2b_ms_k2v2_b8_n32k", "sdpa_decode_b2b_ms_b8_n32k")),
    ("paged_decode_speedup_k4v3_b8_n32k", "same, keys 4 bits, values 3 (120 B/token/head)",
     ("paged_decode_b2b_ms_k4v3_b8_n32k", "sdpa_decode_b2b_ms_b8_n32k")),
    ("decode_host_us_per_call", "host time of one prepared contiguous decode call (compiled launcher), the GPU not "
     "waited for", None),
    ("merge_partials_fraction_b8_n32k", "split merge's share of the paged B=8, N=32K call",
     ("merge_partials_ms_b8_n32k", "paged_decode_ms_b8_n32k")),
    ("fused_decode_speedup_b8_n32k", "decode over the contiguous layout the HF cache holds, B=8, N=32K",
     ("fused_decode_ms_b8_n32k", "sdpa_decode_ms_b8_n32k")),
    ("fa2_prefill_vs_sdpa", "FlashAttention-2 prefill (ours) vs SDPA, causal B=4, H=32, N=4096, D=128",
     ("fa2_prefill_ms", "sdpa_prefill_ms")),
    ("fused_prefill_vs_sdpa",
     "fused TQ4 prefill, 512-token chunk over a 32K compressed prefix, vs SDPA on exact K/V (host time included)",
     ("fused_prefill_ms", "sdpa_chunk_ms")),
    ("compress_hbm_fraction", "compress (randomized Hadamard on tensor cores), fraction of copy bandwidth", None),
    ("decompress_hbm_fraction", "decompress to rotated space, fraction of copy bandwidth", None),
    ("e2e_decode_tokens_per_s_ratio_32k",
     "end-to-end `generate` decode tokens/s vs DynamicCache; Llama-3-8B shape, bf16, B=8, 32K context",
     ("e2e_turboquant_decode_tokens_per_s_32k", "e2e_dynamic_decode_tokens_per_s_32k")),
    ("e2e_decode_tokens_per_s_ratio_bits3_vs_bits4", "end to end, `bits=3` preset vs the default TQ4 cache, same shape",
     ("e2e_turboquant_bits3_decode_tokens_per_s_32k", "e2e_turboquant_decode_tokens_per_s_32k")),
    ("e2e_decode_tokens_per_s_ratio_bits2p5_vs_bits4", "end to end, `bits=2.5` preset vs the default TQ4 cache",
     ("e2e_turboquant_bits2p5_decode_tokens_per_s_32k", "e2e_turboquant_decode_tokens_per_s_32k")),
    ("max_context_ratio", "context that fits in the same KV memory vs DynamicCache", None),
    ("decode_peak_extra_mem_fraction_32k", "extra memory of one decode step / bf16 K/V size, 32K context", None),
)

# Baselines that measure the machine, not this project's code: their range over runs is the run-to-run spread.
SPREAD = (
    ("sdpa_decode_ms_b8_n32k", "SDPA bf16 decode, B=8, N=32K"),
    ("sdpa_prefill_ms", "SDPA bf16 prefill, causal B=4, H=32, N=4096"),
    ("decode_copy_bandwidth", "device copy bandwidth, decode benchmark"),
    ("codec_copy_bandwidth", "device copy bandwidth, codec benchmark"),
    ("e2e_dynamic_decode_tokens_per_s_32k", "DynamicCache end-to-end decode, host-bound"),
)

INTRO = """\
# GPU results

<!-- Generated by `python benchmarks/render_results.py` from `benchmarks/results.json` and `benchmarks/runs/`. -->

`python benchmarks/run_gpu.py` (or `flashquant-hf bench`) runs every GPU test, then every `benchmarks/bench_*.py`.
Times are CUDA events, median of >= 50 calls after a time-based warm-up, inputs rotated beyond L2; every ratio is
against torch SDPA in bf16 (or a device copy) measured in the same run. `benchmarks/results.json` holds the newest
value of every metric; `benchmarks/runs/` one file per run with every value it measured, its command, GPU tests and
a note.
"""

SPREAD_TEXT = """\
## Run-to-run spread

The machine is shared and each run may land on another host: kernel times move by a few percent between runs,
host-bound figures (wall times, end to end) by much more. Compare figures within one run. The baselines below
measure the machine, not this project's code, so their range over the runs is that spread.
"""

RUNS_TEXT = """\
## Runs

`python benchmarks/render_results.py --run N` prints a run's note and values, `--history NAME` one metric over all
runs.
"""

NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def target_bound(target: str | None) -> tuple[str, float] | None:
    """(operator, number) of a target such as '>= 0.60', '< 1e-4', '0' or '>= 0.60 (a note)'; None otherwise."""
    match = re.fullmatch(rf"\s*(>=|<=|>|<|==)?\s*({NUMBER})\s*(?:\(.*\))?\s*", target or "")
    return (match.group(1) or "==", float(match.group(2))) if match else None


def status(value: float, target: str | None) -> str:
    """'met', 'not met', or '' for a target that is not a plain bound."""
    bound = target_bound(target)
    if bound is None:
        return ""
    op, limit = bound
    ok = {">=": value >= limit, ">": value > limit, "<=": value <= limit, "<": value < limit,
          "==": value == limit}[op]
    return "met" if ok else "not met"


def check_run(doc: object, where: str = "run file") -> None:
    """Raise ValueError naming the problem unless ``doc`` is a valid run record."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    for key, kind in RUN_KEYS.items():
        if key not in doc:
            raise ValueError(f"{where}: missing key `{key}`")
        if not isinstance(doc[key], kind) or isinstance(doc[key], bool):
            raise ValueError(f"{where}: `{key}` must be {kind.__name__}, got {type(doc[key]).__name__}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        raise ValueError(f"{where}: `date` must be YYYY-MM-DD, got {doc['date']!r}")
    names = set()
    for i, row in enumerate(doc["results"]):
        if not isinstance(row, dict) or set(row) != set(RESULT_KEYS):
            raise ValueError(f"{where}: results[{i}] must have exactly the keys {RESULT_KEYS}, got {row!r}")
        value = row["value"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{where}: results[{i}] ({row['name']}) has a non-finite or non-numeric value {value!r}")
        if not isinstance(row["name"], str) or not isinstance(row["unit"], str):
            raise ValueError(f"{where}: results[{i}] `name` and `unit` must be strings")
        if row["target"] is not None and not isinstance(row["target"], str):
            raise ValueError(f"{where}: results[{i}] ({row['name']}) `target` must be a string or null")
        if row["name"] in names:
            raise ValueError(f"{where}: `{row['name']}` appears twice")
        names.add(row["name"])


def run_file_name(doc: dict) -> str:
    """``<date>_run<NN>_<commit>.json`` of a run record."""
    commit = re.sub(r"[^0-9A-Za-z.-]", "-", doc["commit"])
    return f"{doc['date']}_run{doc['run']:02d}_{commit}.json"


def load_runs(runs_dir: Path = RUNS_DIR) -> list[dict]:
    """Every run file, checked, in run order; a file whose name does not match its content raises."""
    runs = []
    for path in sorted(runs_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        check_run(doc, str(path.name))
        if path.name != run_file_name(doc):
            raise ValueError(f"{path.name}: its content says it is {run_file_name(doc)}")
        runs.append({**doc, "results": _current_names(doc["results"])})
    numbers = [doc["run"] for doc in runs]
    if len(numbers) != len(set(numbers)):
        raise ValueError(f"two run files share a run number: {sorted(numbers)}")
    return sorted(runs, key=lambda doc: doc["run"])


def _current_names(rows: list[dict]) -> list[dict]:
    return [{**row, "name": RENAMED.get(row["name"], row["name"])} for row in rows]


def load_latest(path: Path = RESULTS_JSON) -> list[dict]:
    """results.json's entries ([] when there is none)."""
    return _current_names(json.loads(path.read_text())) if path.is_file() else []


def merge_latest(previous: list[dict], new: list[dict]) -> list[dict]:
    """results.json after a run: ``previous`` with every metric the run measured replaced by its new entry (in place),
    then the run's new metrics in its order."""
    fresh = {row["name"]: row for row in new}
    merged = [fresh.pop(row["name"], row) for row in previous]
    return merged + [row for row in new if row["name"] in fresh]


def next_run_number(runs_dir: Path = RUNS_DIR) -> int:
    """The number the next run file takes: one more than the highest in ``runs_dir``."""
    numbers = [int(m.group(2)) for path in runs_dir.glob("*.json") if (m := RUN_FILE.fullmatch(path.name))]
    return max(numbers, default=0) + 1


def history(name: str, runs: list[dict]) -> list[tuple[dict, dict]]:
    """(run, result row) for every run that measured ``name``, oldest first."""
    return [(doc, row) for doc in runs for row in doc["results"] if row["name"] == name]


def fmt(value: float, unit: str = "") -> str:
    text = f"{value:.4g}"
    if unit == "x":
        return text + "x"
    if unit in ("", "fraction", "ratio"):
        return text
    return f"{text} {unit}"


def _run_of(row: dict, runs: list[dict]) -> dict | None:
    """The newest run with ``row``'s commit and date that measured ``row``'s metric with its value."""
    for doc in reversed(runs):
        if (doc["commit"], doc["date"]) != (row["commit"], row["date"]):
            continue
        for measured in doc["results"]:
            if measured["name"] == row["name"] and math.isclose(measured["value"], row["value"], rel_tol=1e-9):
                return doc
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _headline(latest: list[dict], runs: list[dict]) -> tuple[list[str], list[dict]]:
    """The headline table's rows and the runs they come from (newest first)."""
    by_name = {row["name"]: row for row in latest}
    lines, used = [], {}
    for name, what, pair in HEADLINE:
        row = by_name.get(name)
        if row is None:
            continue
        value = fmt(row["value"], row["unit"])
        same_run = [by_name.get(n) for n in pair or ()]
        if pair and all(r and (r["commit"], r["date"]) == (row["commit"], row["date"]) for r in same_run):
            value += " ({} vs {})".format(*(fmt(r["value"], r["unit"]) for r in same_run))
        doc = _run_of(row, runs)
        if doc:
            used[doc["run"]] = doc
        where = f"{doc['run']} ({row['commit']})" if doc else f"{row['date']} ({row['commit']})"
        lines.append(f"| `{name}` | {_cell(what)} | {_cell(value)} | {_cell(row['target'] or '')} | "
                     f"{status(row['value'], row['target'])} | {where} |")
    return lines, sorted(used.values(), key=lambda doc: -doc["run"])


def render(latest: list[dict], runs: list[dict]) -> str:
    """The text of RESULTS.md."""
    headline, behind = _headline(latest, runs)
    lines = [INTRO, "## Headline", "", "| metric | what | value | target | status | run |",
             "|---|---|---:|---|---|---|", *headline]
    if behind:
        lines += ["", "The runs behind these rows:", "", "| run | date | commit | GPU | command | GPU tests |",
                  "|---:|---|---|---|---|---|"]
        lines += [f"| {doc['run']} | {doc['date']} | {doc['commit']} | {_cell(doc['gpu'])} | "
                  f"`{_cell(doc['command'])}` | {_cell(doc['tests'])} |" for doc in behind]
    lines += ["", SPREAD_TEXT, "| baseline | min | max | runs |", "|---|---:|---:|---:|"]
    for name, what in SPREAD:
        rows = [row for _, row in history(name, runs)]
        if rows:
            values = [row["value"] for row in rows]
            lines.append(f"| {what} (`{name}`) | {fmt(min(values), rows[0]['unit'])} | "
                         f"{fmt(max(values), rows[0]['unit'])} | {len(rows)} |")
    lines += ["", RUNS_TEXT, "| run | date | commit | command | GPU tests | values |", "|---:|---|---|---|---|---:|"]
    lines += [f"| {doc['run']} | {doc['date']} | {doc['commit']} | `{_cell(doc['command'])}` | "
              f"{_cell(doc['tests'])} | {len(doc['results'])} |" for doc in reversed(runs)]
    return "\n".join(lines) + "\n"


def _print_history(name: str, runs: list[dict]) -> int:
    rows = history(name, runs)
    if not rows:
        print(f"no run measured `{name}`", file=sys.stderr)
        return 1
    print(f"{'run':>4}  {'date':<10}  {'commit':<8}  {'value':>12}  unit")
    for doc, row in rows:
        print(f"{doc['run']:>4}  {doc['date']:<10}  {doc['commit']:<8}  {row['value']:>12.4g}  {row['unit']}")
    return 0


def _print_run(number: int, runs: list[dict]) -> int:
    found = [doc for doc in runs if doc["run"] == number]
    if not found:
        print(f"no run {number} (runs: {[doc['run'] for doc in runs]})", file=sys.stderr)
        return 1
    doc = found[0]
    print(f"run {doc['run']}, {doc['date']}, commit {doc['commit']}, {doc['gpu']}\n$ {doc['command']}\n"
          f"GPU tests: {doc['tests']}\n\n{doc['note']}\n")
    width = max((len(row["name"]) for row in doc["results"]), default=4)
    for row in doc["results"]:
        print(f"{row['name']:<{width}}  {row['value']:>12.4g}  {row['unit']:<9} {row['target'] or ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is not what the files give")
    group.add_argument("--history", metavar="NAME", help="print one metric over all runs")
    group.add_argument("--run", type=int, metavar="N", help="print one run's note and values")
    args = parser.parse_args(argv)
    runs = load_runs()
    if args.history:
        return _print_history(args.history, runs)
    if args.run is not None:
        return _print_run(args.run, runs)
    text = render(load_latest(), runs)
    if args.check:
        if not RESULTS_MD.is_file() or RESULTS_MD.read_text() != text:
            print("benchmarks/RESULTS.md is stale: run python benchmarks/render_results.py", file=sys.stderr)
            return 1
        return 0
    RESULTS_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
