"""Bench rows -> markdown table (``latest.md``) and a PNG chart. Example: ``render(rows, "bench/results")``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .png import COLOURS, write_bars

COLUMNS = ("comm_ratio", "all_gathers", "compute_balance", "param_memory_ratio", "trace_x", "compile_x")


def with_relative_times(rows: list[dict]) -> list[dict]:
    """Add ``trace_x``/``compile_x``: times over the replicated route's for the same model and mesh."""
    base = {(r["family"], r["width"], r["mesh"]): r for r in rows if r["route"] == "g_replicated"}
    for r in rows:
        ref = base.get((r["family"], r["width"], r["mesh"]), {})
        for key, src in (("trace_x", "trace_s"), ("compile_x", "compile_s")):
            if r.get(src) and ref.get(src):
                r[key] = r[src] / ref[src]
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "inf"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], extra: dict[str, Any]) -> str:
    """One table of every model x mesh x route, then the routes that did not run and planning time."""
    head = ("model", "mesh", "route", *COLUMNS)
    lines = ["# xla_tp bench (forward audit; times relative to the replicated route, same run)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") == "ok":
            cells = [_cell(r.get(c)) for c in COLUMNS]
        else:
            cells = [r.get("status", "?")] + [""] * (len(COLUMNS) - 1)
        lines.append("| " + " | ".join([f"{r['family']}-{r['width']}", r["mesh"], r["route"], *cells]) + " |")
    lines += ["", "comm_ratio `inf` = communication where the plan implies none.", ""]
    lines += [f"- **{k}**: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path, metric: str = "compute_balance") -> str:
    """Write a PNG of ``metric`` per model (groups) and route (colours); return its legend."""
    routes = sorted({r["route"] for r in rows if r.get("status") == "ok"})
    groups: dict[str, list[Optional[float]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r["route"] in routes:
            key = f"{r['family']}-{r['width']}@{r['mesh']}"
            groups.setdefault(key, [None] * len(routes))[routes.index(r["route"])] = r.get(metric)
    write_bars(str(path), groups, routes)
    legend = ", ".join(f"{name} = rgb{COLOURS[i % len(COLOURS)]}" for i, name in enumerate(routes))
    return (f"![{metric}]({path.name}) — {metric} per model@mesh (groups, in table order: "
            f"{', '.join(groups)}); bars: {legend}; grey line = 1.0 (optimal), capped at 4")


def render(rows: list[dict], out_dir: Path, extra: dict[str, Any]) -> None:
    """Write ``latest.md`` and ``compute_balance.png`` under ``out_dir``."""
    rows = with_relative_times(rows)
    legend = chart(rows, out_dir / "compute_balance.png")
    (out_dir / "latest.md").write_text(markdown(rows, extra) + "\n" + legend + "\n")
