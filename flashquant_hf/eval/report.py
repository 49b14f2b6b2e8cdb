"""Reporting of evaluation rows: a text table, a JSON file and a matplotlib PNG."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any

from .errors import EvalInputError

COLUMNS = ("name", "perplexity", "delta %", "KV bytes", "compression", "at 32K", "tokens/s", "time s")
LINE_WIDTH = 120


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _ppl_cell(row: dict[str, Any]) -> str:
    if len(row.get("ppl_per_seed", [])) > 1:
        return f"{row['ppl']:.4f} ± {row['ppl_std']:.4f}"
    return f"{row['ppl']:.4f}"


def _ratio(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def _cells(row: dict[str, Any]) -> list[str]:
    seconds = row.get("seconds")
    return [
        row["name"],
        _ppl_cell(row),
        f"{row['delta_pct']:+.2f}%",
        human_bytes(row["kv_bytes"]),
        _ratio(row["compression"]),
        _ratio(row.get("compression_32k")),
        f"{row['tokens_per_s']:.1f}",
        "n/a" if seconds is None else f"{seconds:.1f}",
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: name, perplexity (± std over seeds), delta % vs dynamic, KV bytes, compression (at this
    run's length and projected to 32K tokens), tok/s, the row's seconds."""
    return fixed_width_table(COLUMNS, [_cells(row) for row in rows])


def fixed_width_table(header: list[str], cells: list[list[str]]) -> str:
    """``header``, a rule and one line per row of ``cells``: the first column left-aligned, the others right."""
    widths = [max(len(header[i]), *(len(c[i]) for c in cells)) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for c in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    return "\n".join(lines)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The same table as GitHub markdown (for docs)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def describe_config(config: dict[str, Any]) -> str:
    """What a resolved TurboQuantConfig keeps how, in words (``4-bit keys and values, 4 exact sink tokens, ...``)."""
    key_bits, value_bits = config["key_bits"], config["value_bits"]
    parts = [f"{key_bits}-bit keys and values" if key_bits == value_bits else
             f"{key_bits}-bit keys, {value_bits}-bit values"]
    sinks, window, block = config["sink_tokens"], config["residual_length"], config["window_block"]
    if sinks == 0 and window == 0:
        parts.append("every token compressed")
    if sinks:
        parts.append(f"{sinks} exact sink tokens")
    if window:
        newest = f"{window}" if block == 1 else f"{window} to {window + block - 1}"
        parts.append(f"the newest {newest} tokens exact")
    if config.get("outlier_channels"):
        parts.append(f"{config['outlier_channels']} outlier channels a bit more")
    if config.get("key_qjl"):
        parts.append("QJL key residual")
    return ", ".join(parts)


def legend(rows: list[dict[str, Any]], dtype: str) -> str:
    """Two wrapped lines under the table: what each row is, what each column means."""
    names = [f"{row['name']} = {describe_config(row['config'])}" for row in rows if row.get("config")]
    tokens = rows[0].get("kv_tokens", "the")
    dynamic_ratio = _ratio(rows[0]["compression"])
    text = [
        "rows: dynamic = transformers' DynamicCache, exact K/V (the baseline); " + "; ".join(names) + ".",
        f"columns: delta % = perplexity vs dynamic; KV bytes = what each cache allocates at the end ({tokens} tokens);"
        f" compression = bf16 K/V of those tokens / KV bytes (dynamic holds {dtype}: {dynamic_ratio}), low where the "
        "exact window is a large part of so few tokens; at 32K = the same projected to 32768 tokens, every further "
        "token compressed; time s = the row's wall time (prefill + decode, every seed).",
    ]
    return "\n".join(textwrap.fill(line, LINE_WIDTH, subsequent_indent="  ") for line in text)


def payload(model: str, text: str, prefix: int, tokens: int, rows: list[dict[str, Any]], **extra: Any) -> dict:
    """The JSON document: ``{"model", "text", "prefix", "tokens", "results": [...], **extra}``."""
    return {"model": model, "text": text, "prefix": prefix, "tokens": tokens, **extra, "results": rows}


def _finite(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity: a metric that could not be measured becomes null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, (str, int, bool, type(None), float)):
        return value
    return str(value)


def check_writable(path: str | Path, option: str) -> None:
    """EvalInputError now, before a long run, when ``path`` could not be written later."""
    path = Path(path)
    parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise EvalInputError(f"`{option}` {str(path)!r} cannot be written (not a writable file location)")
    if option == "--plot":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise EvalInputError("`--plot` needs matplotlib: pip install 'flashquant-hf[eval]'") from None


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON (NaN becomes null); EvalInputError when the path is not writable."""
    path = Path(path)
    clean = _finite(document)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    except OSError as err:
        raise EvalInputError(f"`--json` {str(path)!r} could not be written: {err.strerror or err}") from None
    return path


def save_plot(path: str | Path, rows: list[dict[str, Any]], title: str = "") -> Path:
    """A PNG: perplexity per cache (error bars = spread over seeds), labelled with compression and delta %.

    Uses matplotlib's object API with the Agg canvas, so no display or pyplot state is touched.
    """
    names = [row["name"] for row in rows]
    ppls = [row["ppl"] for row in rows]
    spread = [row.get("ppl_std", 0.0) for row in rows]
    fig = agg_figure(figsize=(max(5.0, 1.2 * len(rows) + 2), 4.0))
    ax = fig.add_subplot()
    colors = ["#777777"] + ["#1f77b4"] * (len(rows) - 1)
    # Error bars only where several seeds were run (a zero-length bar still draws its caps).
    bars = ax.bar(names, ppls, yerr=spread if any(spread) else None, color=colors, capsize=4)
    ax.axhline(ppls[0], color="#777777", linestyle="--", linewidth=1)
    for bar, row in zip(bars, rows):
        label = "baseline" if row["name"] == "dynamic" else f"{row['delta_pct']:+.1f}%\n{row['compression']:.2f}x"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    xytext=(0, 6), textcoords="offset points", fontsize=8)
    ax.set_ylabel("decode-faithful perplexity")
    ax.set_ylim(0, max(ppls) * 1.25)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=20)
    return save_figure(fig, path)


def agg_figure(figsize: tuple[float, float]):
    """A matplotlib Figure (constrained layout) on the Agg canvas: no display or pyplot state is touched."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise EvalInputError("`--plot` needs matplotlib: pip install 'flashquant-hf[eval]'") from None
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder created); EvalInputError where it cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise EvalInputError(f"`--plot` {str(path)!r} could not be written: {err.strerror or err}") from None
    return path
