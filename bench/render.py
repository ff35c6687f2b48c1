"""Bench rows -> markdown table (``latest.md``) and a PNG chart: ``render(rows, Path("bench/results"), {})``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .chart import chart
from .timing import TRACES, WARMUP

CHART = "routes.png"
COLUMNS = ("comm_ratio", "all_gathers", "compute_balance", "param_memory_ratio", "comm_ratio_bwd", "all_gathers_bwd",
           "compute_balance_bwd", "trace_fwd_ms", "trace_fwdbwd_ms", "trace_x", "compile_x")
EXECUTIONS = ("eager", "torch_xla.compile", "dynamo")
ONE_OFF_TRACES = {"f_jax_torchax"}  # JAX traces once per shape: its trace time is not a per-step cost


def step_key(execution: str) -> str:
    """The row key of a step-time ratio: ``step_key("torch_xla.compile") == "step_x_torch_xla_compile"``."""
    return "step_x_" + execution.replace(".", "_")


def with_relative_times(rows: list[dict]) -> list[dict]:
    """Add ratios to the replicated route of the same model and mesh: ``trace_x`` (forward+backward
    trace median; ``trace_x_min``/``_max`` from the route's min/max), ``compile_x``, and per execution
    route ``step_x_*`` (steady-state step median)."""
    base = {(r["family"], r["width"], r["mesh"]): r for r in rows if r["route"] == "g_replicated"}
    for r in rows:
        ref = base.get((r["family"], r["width"], r["mesh"]), {})
        if r.get("compile_s") and ref.get("compile_s"):
            r["compile_x"] = r["compile_s"] / ref["compile_s"]
        for key in ("trace_fwd", "trace_fwdbwd"):
            if key in r:
                r[f"{key}_ms"] = r[key]
        if r.get("trace_fwdbwd") and ref.get("trace_fwdbwd") and r["route"] not in ONE_OFF_TRACES:
            mine, theirs = r["trace_fwdbwd"], ref["trace_fwdbwd"]["median"]
            r["trace_x"], r["trace_x_min"], r["trace_x_max"] = (mine[k] / theirs for k in ("median", "min", "max"))
        for execution in EXECUTIONS:
            mine, theirs = r.get("steps", {}).get(execution, {}), ref.get("steps", {}).get(execution, {})
            if "median" in mine and "median" in theirs:
                r[step_key(execution)] = mine["median"] / theirs["median"]
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "inf"
    if isinstance(value, dict):  # timing stats: median (min-max) in ms
        return f"{value['median'] * 1e3:.1f} ({value['min'] * 1e3:.1f}-{value['max'] * 1e3:.1f})"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _step_cell(s: dict) -> str:
    if "median" not in s:
        return s.get("status", "?")
    return f"{_cell(s)}; compiles {s['warmup_compiles']} + {s['compiles']}"


def markdown(rows: list[dict], extra: dict[str, Any]) -> str:
    """The table of every model x mesh x route, the training-step table, then the notes."""
    head = ("model", "mesh", "route", *COLUMNS)
    lines = ["# xla_tp bench (same run; `_bwd` = the forward+backward program; `_x` = over the replicated "
             "route's)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") == "ok":
            cells = [_cell(r[c]) if c in r else "n/a" for c in COLUMNS]
        else:
            cells = [r.get("status", "?")] + [""] * (len(COLUMNS) - 1)
        lines.append("| " + " | ".join([f"{r['family']}-{r['width']}", r["mesh"], r["route"], *cells]) + " |")
    lines += ["", "comm_ratio `inf` = communication where the plan implies none; `n/a` = not measured. "
              f"Trace times: process CPU ms of one traced program, median (min-max) of {TRACES} after {WARMUP} warm-up traces.", ""]
    stepped = [r for r in rows if r.get("steps")]
    if stepped:
        lines += ["## Training steps (forward, backward, SGD): steady-state ms per step, median (min-max) of 5 "
                  "after 3 warm-up steps; compiles in the warm-up + in the 5 measured steps", "",
                  "| model | mesh | route | " + " | ".join(EXECUTIONS) + " |", "|" + "---|" * (3 + len(EXECUTIONS))]
        for r in stepped:
            cells = [_step_cell(r["steps"].get(e, {})) for e in EXECUTIONS]
            lines.append("| " + " | ".join([f"{r['family']}-{r['width']}", r["mesh"], r["route"], *cells]) + " |")
        lines.append("")
    lines += [f"- **{k}**: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def render(rows: list[dict], out_dir: Path, extra: dict[str, Any]) -> None:
    """Write ``latest.md`` and the chart (``CHART``) under ``out_dir``."""
    rows = with_relative_times(rows)
    legend = chart(rows, out_dir / CHART)
    (out_dir / "latest.md").write_text(markdown(rows, extra) + "\n" + legend + "\n")
