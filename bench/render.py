"""Bench rows -> markdown table (``latest.md``) and a PNG chart: ``render(rows, Path("bench/results"), {})``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .chart import chart

CHART = "routes.png"
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
            cells = [_cell(r[c]) if c in r else "n/a" for c in COLUMNS]
        else:
            cells = [r.get("status", "?")] + [""] * (len(COLUMNS) - 1)
        lines.append("| " + " | ".join([f"{r['family']}-{r['width']}", r["mesh"], r["route"], *cells]) + " |")
    lines += ["", "comm_ratio `inf` = communication where the plan implies none; `n/a` = not measured.", ""]
    lines += [f"- **{k}**: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def render(rows: list[dict], out_dir: Path, extra: dict[str, Any]) -> None:
    """Write ``latest.md`` and the chart (``CHART``) under ``out_dir``."""
    rows = with_relative_times(rows)
    legend = chart(rows, out_dir / CHART)
    (out_dir / "latest.md").write_text(markdown(rows, extra) + "\n" + legend + "\n")
