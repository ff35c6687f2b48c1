"""The bench chart: one panel per metric (rows) and mesh (columns), grouped bars per model, one colour per route.

Drawn with matplotlib's Agg backend (no display needed). Metrics are ratios to the ideal, so every
panel has a log2 y axis with a dashed line at 1.0 (optimal). A ``comm_ratio`` of None (communication
where the plan implies none) is drawn as a hatched bar to the top of the panel marked "inf"; a
route that failed on a model is an "x" at the bottom of its slot; routes that never produced a
number are listed under the legend with their reason. Example::

    caption = chart(rows, Path("bench/results/routes.png"))
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

METRICS = {
    "comm_ratio": "communication / plan minimum",
    "comm_ratio_bwd": "forward+backward:\ncommunication / plan minimum",
    "compute_balance": "dot FLOPs x devices / unsharded",
    "param_memory_ratio": "param bytes per device / ideal",
    "trace_x": "forward+backward trace time\n/ replicated (bars: min-max)",
    "step_x_eager": "training step, eager\n/ replicated",
    "step_x_torch_xla_compile": "training step, torch_xla.compile\n/ replicated",
    "step_x_dynamo": "training step, dynamo\n/ replicated",
}
TIMES = {m for m in METRICS if m.startswith(("trace", "step"))}
TOP = 16.0  # y limit of every panel: ratios above it (and inf) are drawn to the top


def _label(row: dict) -> str:
    return f"{row['family']}-{row['width']}"


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _bar_value(row: dict, metric: str) -> Optional[float]:
    """The height to draw (None: nothing to draw); inf and large values are clipped to ``TOP``."""
    value = row.get(metric)
    if value is None:
        return TOP if metric == "comm_ratio" and metric in row else None
    return min(float(value), TOP)


def _panel(ax, rows: list[dict], metric: str, mesh: str, routes: list[str], colours: dict, models: list[str]) -> None:
    width = 0.8 / len(routes)
    for i, route in enumerate(routes):
        for row in (r for r in rows if r["mesh"] == mesh and r["route"] == route):
            x = models.index(_label(row)) - 0.4 + width * (i + 0.5)
            if row.get("status") != "ok":
                ax.plot(x, 1.0, marker="x", color=colours[route], markersize=7, mew=2)
                continue
            value = _bar_value(row, metric)
            if value is None:
                continue
            clipped = row.get(metric) is None or float(row[metric]) > TOP
            ax.bar(x, value, width, color=colours[route], edgecolor="black", linewidth=0.4,
                   hatch="//" if clipped else None)
            if f"{metric}_min" in row:  # the spread of the route's own samples
                ax.errorbar(x, value, yerr=[[max(value - row[f"{metric}_min"], 0)], [max(row[f"{metric}_max"] - value, 0)]],
                            color="black", capsize=2, linewidth=0.8)
            if value > 1.05:
                text = "inf" if row.get(metric) is None else f"{float(row[metric]):.2g}"
                ax.text(x, value * 1.04, text, ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log", base=2)
    if metric in TIMES:  # a time can beat the replicated route's
        ax.set_ylim(0.2, TOP * 2.2)
        ax.set_yticks([0.25, 0.5, 1, 2, 4, 8, 16])
        ax.set_yticklabels(["0.25", "0.5", "1 (replicated)", "2", "4", "8", "16+"])
    else:
        ax.set_ylim(0.7, TOP * 2.2)
        ax.set_yticks([1, 2, 4, 8, 16])
        ax.set_yticklabels(["1 (optimal)", "2", "4", "8", "16+"])
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, rotation=35, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.set_title(f"{metric} on mesh {mesh}", fontsize=11)
    ax.set_ylabel(f"{METRICS[metric]}\n(log2, lower is better)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def chart(rows: list[dict], path: Path) -> str:
    """Write the chart to ``path``; return a one-line markdown caption linking it."""
    meshes = sorted(_ordered([r["mesh"] for r in rows]), key=lambda m: (math.prod(map(int, m.split("x"))), m))
    models = _ordered([_label(r) for r in rows])
    all_routes = sorted({r["route"] for r in rows})
    drawn = [route for route in all_routes if any(r["route"] == route and r.get("status") == "ok" for r in rows)]
    palette = plt.get_cmap("tab10").colors
    colours = {route: palette[i % len(palette)] for i, route in enumerate(all_routes)}
    metrics = [m for m in METRICS if any(m in r for r in rows)] or list(METRICS)[:1]
    fig, axes = plt.subplots(len(metrics), len(meshes), figsize=(max(6.5 * len(meshes), 12.0), 4.2 * len(metrics)),
                             squeeze=False)
    for i, metric in enumerate(metrics):
        for j, mesh in enumerate(meshes):
            _panel(axes[i][j], rows, metric, mesh, drawn, colours, models)
    handles = [Patch(facecolor=colours[r], edgecolor="black", label=r) for r in drawn]
    handles += [Line2D([], [], color="grey", linestyle="--", label="1.0 = optimal"),
                Line2D([], [], color="black", marker="x", linestyle="", label="route failed on this model (see table)"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label=f"inf or above {TOP:g} (clipped)")]
    fig.legend(handles=handles, loc="upper center", ncol=math.ceil(len(handles) / 2), fontsize=9,
               bbox_to_anchor=(0.5, 0.985), frameon=False)
    never = [f"{route}: {next(r['status'] for r in rows if r['route'] == route)}"
             for route in all_routes if route not in drawn]
    fig.suptitle("xla_tp bench: every route on every model and mesh (1.0 is optimal, or the replicated route's time)",
                 fontsize=14, y=0.999)
    if never:
        fig.text(0.5, 0.005, "No numbers (not drawn): " + "  |  ".join(never), ha="center", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.94))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return (f"![bench chart]({path.name}) — per metric (rows) and mesh (columns): one group of bars per "
            f"model, one colour per route, log2 scale, dashed line at 1.0 = optimal.")
