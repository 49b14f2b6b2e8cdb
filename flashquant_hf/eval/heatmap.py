"""Reporting of retrieval results: accuracy per length as a text table, and one heat-map per cache (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .report import agg_figure, fixed_width_table, save_figure


def _length_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def format_accuracy(rows: list[dict[str, Any]], lengths: Sequence[int]) -> str:
    """Correct needles / needles per length for each cache, and the total."""
    header = ["name", *(_length_label(n) for n in lengths), "all"]
    cells = []
    for row in rows:
        per_length = [f"{c}/{n}" for c, n in zip(row["correct"], row["needles"])]
        cells.append([row["name"], *per_length, f"{sum(row['correct'])}/{sum(row['needles'])}"])
    return fixed_width_table(header, cells)


def draw_heatmaps(fig, document: dict[str, Any]) -> None:
    """One panel per cache: x = prompt length, y = needle depth (0 % on top), colour = accuracy (red 0, green 1).

    ``document`` is the ``niah`` JSON; ``fig`` a matplotlib Figure with no axes yet.
    """
    from matplotlib.colors import LinearSegmentedColormap

    rows, lengths, depths = document["results"], document["lengths"], document["depths"]
    cmap = LinearSegmentedColormap.from_list("retrieval", ["#d7301f", "#fdd49e", "#1a9850"])
    axes = fig.subplots(1, len(rows), sharey=True, squeeze=False)[0]
    image = None
    for ax, row in zip(axes, rows):
        grid = [[row["cells"][i][j] for i in range(len(lengths))] for j in range(len(depths))]
        values = [[float("nan") if v is None else v for v in line] for line in grid]
        image = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        for j, line in enumerate(grid):
            for i, value in enumerate(line):
                if value is not None:
                    ax.text(i, j, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        total = f"{sum(row['correct'])}/{sum(row['needles'])}"
        ax.set_title(f"{row['name']} ({total})", fontsize=9)
        ax.set_xlabel("prompt tokens")
    axes[0].set_ylabel("needle depth")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="retrieval accuracy", shrink=0.9)


def save_heatmaps(path: str | Path, document: dict[str, Any]) -> Path:
    """Write the heat-maps of ``document`` (the ``niah`` JSON) as a PNG, with matplotlib's Agg canvas."""
    fig = agg_figure(figsize=(2.2 * len(document["results"]) + 1.5, 3.2))
    draw_heatmaps(fig, document)
    needles = document.get("needles_per_cell")
    fig.suptitle(f"{document.get('model', '')}: pass-key retrieval, {needles} needle(s) per cell", fontsize=9)
    return save_figure(fig, path)
