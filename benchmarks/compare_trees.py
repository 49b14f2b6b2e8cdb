"""Benchmark modules of two source trees, interleaved, on one GPU: a before/after figure for a change that must not
change speed.

    python benchmarks/compare_trees.py BEFORE_TREE [--modules bench_codec bench_prefill] [--pairs 2] [--out FILE]

BEFORE_TREE is a checkout of the earlier revision (``git worktree add``, or ``git archive REV | tar -x``); the
tree this file lives in is "after". Each pair runs the modules' ``run(record)`` in a fresh process of each tree,
before then after, and the file keeps every sample: ``{"before": [[{name, value, unit}, ...], ...], "after": ...}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

AFTER = Path(__file__).resolve().parents[1]
_COLLECT = """
import importlib, json, sys
sys.path.insert(0, ".")
rows = []
def record(name, value, unit, target=None):
    rows.append({"name": name, "value": float(value), "unit": unit})
for module in sys.argv[1:]:
    importlib.import_module(f"benchmarks.{module}").run(record)
print(json.dumps(rows))
"""


def sample(tree: Path, modules: list[str]) -> list[dict]:
    """One process of ``tree`` running ``modules``; their records."""
    done = subprocess.run([sys.executable, "-c", _COLLECT, *modules], cwd=tree, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("--modules", nargs="+", default=["bench_codec", "bench_prefill"])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("compare_trees.json"))
    args = parser.parse_args(argv)
    samples: dict[str, list] = {"before": [], "after": []}
    for _ in range(args.pairs):
        samples["before"].append(sample(args.before.resolve(), args.modules))
        samples["after"].append(sample(AFTER, args.modules))
        args.out.write_text(json.dumps(samples, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
