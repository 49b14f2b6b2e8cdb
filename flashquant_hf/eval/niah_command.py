"""The ``niah`` command: pass-key retrieval per (length, depth) for DynamicCache and each cache configuration."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .command import add_run_arguments, argument_type, positive_int, prepare_run
from .errors import EvalInputError
from .specs import PRESETS, parse_cache_spec, unique_names

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_NEEDLES = 1
DEFAULT_CONFIGS = ("tq4", "tq3", "tq2.5")

DESCRIPTION = (
    "Needle in a haystack (pass-key retrieval): a random 5-digit pass key at several depths of repeated filler "
    "text of several lengths. The context is prefilled as one chunk, then the question is fed as a later chunk "
    "and the answer generated greedily, so it attends over what each cache stored. Scored by exact number match."
)
EPILOG = (
    f"--config as for `flashquant-hf ppl`: a preset ({', '.join(sorted(PRESETS))}) and/or TurboQuantConfig "
    "field=value items. Default: " + " ".join(f"--config {c}" for c in DEFAULT_CONFIGS) + "."
)


_depth = argument_type(float, "a depth in [0, 1]", lambda value: 0.0 <= value <= 1.0)


def add_niah_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``niah`` options to ``parser``."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.add_argument("--model", default="smollm2",
                        help="HF hub id, local model dir or .gguf file (default: the embedded SmolLM2-135M GGUF)")
    parser.add_argument("--lengths", type=positive_int(64), nargs="+", metavar="TOKENS", default=DEFAULT_LENGTHS,
                        help="prompt lengths in tokens, answer included (default: "
                        f"{' '.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--depths", type=_depth, nargs="+", metavar="FRACTION", default=DEFAULT_DEPTHS,
                        help="needle depths as fractions of the filler, 0 = first (default: "
                        f"{' '.join(map(str, DEFAULT_DEPTHS))})")
    parser.add_argument("--needles", type=positive_int(1), default=DEFAULT_NEEDLES,
                        help=f"needles (random keys) per length and depth (default: {DEFAULT_NEEDLES})")
    parser.add_argument("--config", action="append", metavar="SPEC", dest="configs",
                        help="a cache configuration to evaluate (repeatable; see below)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default: 0)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="instead of running: merge the --json files of runs over other lengths, or other depths "
                        "of one length (same needles, seed and caches), and write them as one --json / --plot")
    add_run_arguments(parser, plot_help="write the accuracy heat-maps (PNG)")
    return parser


def run_niah(args: argparse.Namespace) -> int:
    """Run the ``niah`` command; EvalInputError for bad input (raised before the model loads where possible)."""
    from .heatmap import format_accuracy, save_heatmaps
    from .loading import check_context, load_model
    from .needle import prompt_parts
    from .report import write_json
    from .retrieval import run_retrieval

    if args.merge:
        return _merge(args)
    started = time.perf_counter()
    specs = [parse_cache_spec(spec) for spec in (args.configs or DEFAULT_CONFIGS)]
    unique_names(specs)
    lengths, depths = sorted(set(args.lengths)), sorted(set(args.depths))
    device, dtype = prepare_run(args)
    model, tokenizer = load_model(args.model, device, dtype, progress=not args.no_progress)
    check_context(model, max(lengths), "`--lengths`")
    parts = prompt_parts(tokenizer)
    document = run_retrieval(model, tokenizer, parts, lengths, depths, args.needles, specs, seed=args.seed,
                             progress=not args.no_progress)
    wall_s = time.perf_counter() - started

    print(f"model {args.model} | pass key | {args.needles} needle(s) x {len(depths)} depths per length | "
          f"{device.type} {str(dtype).removeprefix('torch.')}")
    print(format_accuracy(document["results"], lengths))
    print(f"wall time {wall_s:.1f} s")
    document = {
        "model": args.model, "task": "passkey", "chat_template": parts.chat_template, "lengths": lengths,
        "depths": depths, "needles_per_cell": args.needles, "seed": args.seed, "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "wall_s": wall_s, **document,
    }
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        print(f"wrote {save_heatmaps(args.plot, document)}")
    return 0


def _read_document(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise EvalInputError(f"`--merge` {path!r} is not a readable niah --json file: {err}") from None


def _merge(args: argparse.Namespace) -> int:
    """``--merge``: one document (table, --json, --plot) from the documents of several runs."""
    from .heatmap import format_accuracy, save_heatmaps
    from .report import check_writable, write_json
    from .retrieval import merge_runs

    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, option)
    try:
        document = merge_runs([_read_document(path) for path in args.merge])
    except (KeyError, TypeError, ValueError) as err:
        raise EvalInputError(f"`--merge`: the runs cannot be merged: {err}") from None
    print(f"model {document['model']} | pass key | {len(args.merge)} runs merged")
    print(format_accuracy(document["results"], document["lengths"]))
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        print(f"wrote {save_heatmaps(args.plot, document)}")
    return 0
