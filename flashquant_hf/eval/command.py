"""The ``ppl`` command: options, input checks (all before the model loads), the run and its output."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .errors import EvalInputError
from .specs import PRESETS, parse_cache_spec, unique_names
from .text import DEFAULT_TEXT

DEFAULT_CONFIGS = ("tq4", "tq3")  # the presets; tq4-r0 (every token compressed) on request
DEFAULT_PREFIX = 1024
DEFAULT_TOKENS = 384

DESCRIPTION = (
    "Decode-faithful perplexity: prefill --prefix tokens, then teacher-forced single-token steps over --tokens "
    "tokens through the cache, for DynamicCache and each --config, on the same tokens."
)
EPILOG = (
    f"--config takes a preset ({', '.join(sorted(PRESETS))}) and/or TurboQuantConfig field=value items, "
    "comma-separated, e.g. --config tq4 --config 'tq3,residual_length=0' --config 'bits=4,residual_length=0,"
    "name=tq4-plain'. Default: " + " ".join(f"--config {c}" for c in DEFAULT_CONFIGS) + "."
)


def argument_type(convert, expected: str, accept):
    """An argparse type: ``convert(text)`` if ``accept`` takes it, else the error "expected {expected}, got ..."."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def positive_int(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    return argument_type(int, f"an integer >= {minimum}", lambda value: value >= minimum)


def add_ppl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``ppl`` options to ``parser`` (shared by ``flashquant-hf ppl`` and ``python -m flashquant_hf.eval``)."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.add_argument("--model", default="smollm2",
                        help="HF hub id, local model dir or .gguf file (default: the embedded SmolLM2-135M GGUF)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text-file", metavar="PATH", help=f"UTF-8 text to score (default: {DEFAULT_TEXT})")
    source.add_argument("--dataset", metavar="NAME[:CONFIG]",
                        help="a HuggingFace dataset through `datasets`, e.g. wikitext-2 or wikitext:wikitext-2-raw-v1")
    parser.add_argument("--split", default="test", help="dataset split (default: test)")
    parser.add_argument("--prefix", type=positive_int(1), default=DEFAULT_PREFIX,
                        help=f"prefilled tokens (default: {DEFAULT_PREFIX})")
    parser.add_argument("--tokens", type=positive_int(2), default=DEFAULT_TOKENS,
                        help=f"scored tokens, one decode step each (default: {DEFAULT_TOKENS})")
    parser.add_argument("--config", action="append", metavar="SPEC", dest="configs",
                        help="a cache configuration to evaluate (repeatable; see below)")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                        help="rotation seeds to average each configuration over (default: the config's seed)")
    add_run_arguments(parser, plot_help="write a perplexity bar chart (PNG)")
    return parser


def add_run_arguments(parser: argparse.ArgumentParser, plot_help: str) -> None:
    """Add the options every evaluation command takes last: where the model runs and what the run writes."""
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--threads", type=positive_int(1), metavar="N",
                        help="CPU threads for torch (default: torch's own choice)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help=plot_help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the model loader's too)")


def prepare_run(args: argparse.Namespace):
    """The options of ``add_run_arguments`` applied before the model loads: (device, dtype) resolved, the output
    paths checked writable, torch's CPU threads set. EvalInputError for bad input."""
    from .loading import resolve_device, resolve_dtype
    from .report import check_writable

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, option)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return device, dtype


def run_ppl(args: argparse.Namespace) -> int:
    """Run the ``ppl`` command; EvalInputError for bad input (raised before the model loads where possible)."""
    from .loading import check_context, load_model
    from .report import format_table, legend, payload, save_plot, write_json
    from .runner import evaluate
    from .text import load_text, token_window

    started = time.perf_counter()
    # Every check that needs no model runs first: the model load is the slow part.
    text, text_name = load_text(args.text_file, args.dataset, split=args.split)
    specs = [parse_cache_spec(spec) for spec in (args.configs or DEFAULT_CONFIGS)]
    unique_names(specs)
    device, dtype = prepare_run(args)
    loading = time.perf_counter()
    model, tokenizer = load_model(args.model, device, dtype, progress=not args.no_progress)
    load_s = time.perf_counter() - loading
    check_context(model, args.prefix + args.tokens, "`--prefix` + `--tokens`")
    input_ids = token_window(tokenizer, text, args.prefix, args.tokens)
    rows = evaluate(model, input_ids, args.prefix, specs, seeds=args.seeds, progress=not args.no_progress)
    wall_s = time.perf_counter() - started

    print(f"model {args.model} | text {text_name} | prefix {args.prefix} | tokens {args.tokens} | "
          f"{device.type} {str(dtype).removeprefix('torch.')}")
    print(format_table(rows))
    print(legend(rows, str(dtype).removeprefix("torch.")))
    print(f"wall time {wall_s:.1f} s (model load {load_s:.1f} s, rows {sum(row['seconds'] for row in rows):.1f} s)")
    document = payload(args.model, text_name, args.prefix, args.tokens, rows,
                       device=str(device), dtype=str(dtype).removeprefix("torch."), wall_s=wall_s)
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        title = f"{args.model} on {text_name}: prefix {args.prefix}, {args.tokens} decode-faithful tokens"
        print(f"wrote {save_plot(args.plot, rows, title)}")
    return 0


def run_guarded(func, args: argparse.Namespace, prog: str) -> int:
    """Call ``func(args)``; bad input prints one line ``PROG: error: ...`` to stderr and returns 2."""
    try:
        return func(args)
    except EvalInputError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None, prog: str = "python -m flashquant_hf.eval") -> int:
    """``python -m flashquant_hf.eval [ppl options]``."""
    parser = add_ppl_arguments(argparse.ArgumentParser(prog=prog))
    args = parser.parse_args(argv)
    return run_guarded(run_ppl, args, prog)
