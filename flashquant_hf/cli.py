"""The ``flashquant-hf`` console command: ``ppl`` (decode-faithful perplexity), ``niah`` (pass-key retrieval) and
``bench`` (GPU benchmarks)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Sequence

from .eval.command import add_ppl_arguments, run_guarded, run_ppl
from .eval.errors import EvalInputError
from .eval.niah_command import add_niah_arguments, run_niah

PROG = "flashquant-hf"


def _import_run_gpu():
    """``benchmarks.run_gpu`` from the source checkout (it is not part of the installed package)."""
    try:
        return importlib.import_module("benchmarks.run_gpu")
    except ImportError:
        pass
    # An editable install or a run from the checkout: the repository root holds benchmarks/ beside the package.
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / "benchmarks" / "run_gpu.py").is_file():
            sys.path.insert(0, str(root))
            sys.modules.pop("benchmarks", None)
            return importlib.import_module("benchmarks.run_gpu")
    raise EvalInputError(
        "needs the repository's benchmarks/ directory, which is not installed with the package: "
        "run it from a source checkout (git clone ... && pip install -e . && flashquant-hf bench)"
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/run_gpu.py's main with the given options; exit 2 with one line on a CPU machine."""
    import torch

    if not torch.cuda.is_available():
        raise EvalInputError("needs a CUDA GPU, and torch sees none on this machine")
    run_gpu = _import_run_gpu()
    forwarded = [*(["--only", *args.only] if args.only else []), *(["--skip-tests"] if args.skip_tests else []),
                 *(["--out", args.out] if args.out else [])]
    if inspect.signature(run_gpu.main).parameters:
        return int(run_gpu.main(forwarded) or 0)
    saved = sys.argv
    # This run_gpu.main() takes no argv and parses sys.argv itself.
    sys.argv = [str(Path(run_gpu.__file__)), *forwarded]
    try:
        return int(run_gpu.main() or 0)
    finally:
        sys.argv = saved


def build_parser() -> argparse.ArgumentParser:
    """The ``flashquant-hf`` parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="TurboQuant KV cache for HuggingFace transformers: perplexity and retrieval evaluation, GPU "
        "benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{ppl,niah,bench}")
    ppl = sub.add_parser("ppl", help="decode-faithful perplexity of DynamicCache vs TurboQuant configurations")
    add_ppl_arguments(ppl)
    ppl.set_defaults(func=run_ppl)
    niah = sub.add_parser("niah", help="needle-in-a-haystack (pass-key) retrieval accuracy per length and depth")
    add_niah_arguments(niah)
    niah.set_defaults(func=run_niah)
    bench = sub.add_parser(
        "bench", help="GPU tests and kernel benchmarks (benchmarks/run_gpu.py; needs a CUDA GPU)",
        description="Run benchmarks/run_gpu.py from the source checkout: every GPU test, then every benchmark; "
        "writes benchmarks/results.json.",
    )
    bench.add_argument("--only", nargs="+", metavar="NAME",
                       help="run only benchmarks whose module name contains one of these")
    bench.add_argument("--skip-tests", action="store_true", help="benchmarks only, no GPU tests")
    bench.add_argument("--out", metavar="DIR", help="also copy results.json and the logs here (default: $OUT)")
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashquant-hf``; returns the exit code (0 ok, 2 bad input or no GPU for ``bench``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_guarded(args.func, args, f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
