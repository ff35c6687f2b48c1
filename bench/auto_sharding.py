"""Route (e): XLA's own auto-sharding, tried for real in a child process on CPU.

torch_xla turns auto-sharding on for the whole process (``use_spmd(auto=True)``, read once at the
first compile), so it runs in a fresh Python: the model is moved to the device unannotated, one
forward is compiled and executed with ``use_auto_spmd_partitioning``, and the program XLA
actually compiled is read from its own dump (``XLA_FLAGS=--xla_dump_to``) with the parsers every
other route uses. The unsharded FLOPs are those of the same program before partitioning. The
child also records which SPMD passes the compiler ran, so the row says whether an auto-sharding
pass exists on this backend. A crash or timeout is recorded as the row's status. Example::

    row = auto_sharding_row("torch_encoder", "tiny", {"data": 1, "model": 8})
    row["status"], row.get("compute_balance"), row.get("spmd_passes")
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TIMEOUT_S = 120
AUTO_MESH_ENV = "XLA_AUTO_SPMD_MESH"
_PASS_RE = re.compile(r"\.after_([\w\-]+)\.before_")
_SPMD_PASS_RE = re.compile(r"shard|spmd|partition")


def auto_sharding_row(family: str, width: str, sizes: dict[str, int], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run the child for ``family``/``width`` on a ``data x model`` auto-sharding mesh; return its row fields."""
    mesh = f"{sizes.get('data', 1)},{sizes.get('model', 1)}"
    with tempfile.TemporaryDirectory(prefix="xla_auto_") as tmp:
        flags = (f"--xla_dump_to={tmp}/dump --xla_dump_hlo_as_text --xla_dump_hlo_as_long_text "
                 f"--xla_dump_hlo_module_re=SyncTensorsGraph.* --xla_dump_hlo_pass_re=sharding|spmd")
        env = {k: v for k, v in os.environ.items() if k != "XLA_DUMP_POST_OPTIMIZATIONS"}
        env.update({AUTO_MESH_ENV: mesh,
                    "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {flags}".strip()})
        out = Path(tmp) / "row.json"
        how = f"torch_xla use_spmd(auto=True), {AUTO_MESH_ENV}={mesh}, unannotated model"
        cmd = [sys.executable, "-m", "bench.auto_sharding", family, width, json.dumps(sizes), tmp, str(out)]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                                  cwd=Path(__file__).parent.parent)
        except subprocess.TimeoutExpired:
            return {"how": how, "status": f"fails: no result within the {timeout:.0f} s timeout"}
        if done.returncode != 0 or not out.exists():
            return {"how": how, "status": f"fails: {_last_error(done.stderr)}"}
        return {"how": how, **json.loads(out.read_text())}


def _last_error(stderr: str) -> str:
    """The exception line of a traceback (else the last non-empty line), at most 200 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:200]


def _measure(family: str, width: str, sizes: dict[str, int], dump: Path) -> dict[str, Any]:
    """In the child: compile and run one forward with auto-sharding, read XLA's own dump."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    xr.use_spmd(auto=True)  # before any tensor reaches the device

    from xla_tp.auditing.hlo import dot_flops, parse_collectives
    from xla_tp.auditing.params import param_bytes
    from xla_tp.auditing.report import AuditReport
    from xla_tp.zoo import registry

    from .models import build
    model, batch, _ = build(family, width)
    model = model.to(torch_xla.device())
    start = time.perf_counter()
    out = registry.run(model, batch.to(torch_xla.device()))
    torch_xla.sync()  # compiles `out` with auto-sharding, runs it, then reshards the parameters
    out.cpu()
    run_s = time.perf_counter() - start
    graphs = sorted(dump.glob("module_*.SyncTensorsGraph.*.cpu_after_optimizations.txt"),
                    key=lambda p: p.stat().st_size)
    if not graphs:
        raise RuntimeError(f"XLA wrote no compiled SyncTensorsGraph to {dump}")
    compiled = graphs[-1].read_text()  # the model's forward: the largest graph
    before = graphs[-1].with_name(graphs[-1].name.replace("cpu_after_optimizations", "before_optimizations"))
    found = parse_collectives(compiled)
    collectives: dict[str, dict] = {}
    for c in found:
        entry = collectives.setdefault(c.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    report = AuditReport(mesh=sizes, backward=False, collectives=collectives,
                         comm_bytes=sum(c.bytes for c in found), comm_minimum_bytes=0,
                         flops_per_device=dot_flops(compiled), unsharded_flops=dot_flops(before.read_text()))
    report.param_bytes_per_device, report.param_bytes_total = param_bytes(model)
    sharded = sorted(n for n, p in model.named_parameters() if torch_xla._XLAC._get_xla_sharding_spec(p))
    passes = sorted({m.group(1) for f in dump.iterdir() for m in [_PASS_RE.search(f.name)]
                     if m and _SPMD_PASS_RE.search(m.group(1))})
    data = report.to_dict()
    return {"status": "ok", "all_gathers": report.count("all-gather"),
            **{k: data[k] for k in ("comm_ratio", "compute_balance", "param_memory_ratio", "collectives")},
            "auto_compiles": met.counter_value("CompileWithAutoSharding") or 0,
            "spmd_passes": passes, "auto_sharding_pass": any("auto" in p for p in passes),
            "params_sharded": len(sharded), "params_total": len(list(model.parameters())),
            "run_s": round(run_s, 3)}


def summary(rows: list[dict]) -> str:
    """One sentence on what route (e) did, from its rows (for the markdown notes).

    >>> summary([{"route": "e_xla_auto_sharding", "family": "bert", "width": 64, "mesh": "1x8",
    ...           "status": "fails: RuntimeError: boom"}])
    'tried on bert-64 @ 1x8: fails: RuntimeError: boom'
    """
    parts = []
    for r in (r for r in rows if r["route"] == "e_xla_auto_sharding"):
        where = f"{r['family']}-{r['width']} @ {r['mesh']}"
        if r.get("status") != "ok":
            parts.append(f"tried on {where}: {r.get('status')}")
            continue
        passes = ", ".join(r.get("spmd_passes", [])) or "none dumped"
        pass_note = ("an auto-sharding pass ran" if r.get("auto_sharding_pass") else
                     f"the CPU compiler ran no auto-sharding pass (SPMD passes: {passes})")
        parts.append(f"ran on {where} ({r.get('how')}; {r.get('auto_compiles')} auto-sharding compile): "
                     f"{pass_note}; {r.get('params_sharded')}/{r.get('params_total')} parameters sharded, "
                     f"compute_balance {r.get('compute_balance')}, param_memory_ratio {r.get('param_memory_ratio')}, "
                     f"{sum(c['count'] for c in r.get('collectives', {}).values())} collectives")
    return "; ".join(parts) or "not run"


if __name__ == "__main__":  # python -m bench.auto_sharding FAMILY WIDTH SIZES_JSON TMPDIR OUT_JSON
    _family, _width, _sizes, _tmp, _out = sys.argv[1:6]
    _row = _measure(_family, _width, json.loads(_sizes), Path(_tmp) / "dump")
    Path(_out).write_text(json.dumps(_row))
