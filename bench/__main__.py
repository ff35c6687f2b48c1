"""``python -m bench``: every model x mesh x route, written to bench/results/.

Each row: the forward audit, and on the 8-device meshes (for routes a, b, g) the forward+backward
audit, trace times (median, min, max of 9 after warm-up), and on the last mesh at the first width
the training-step times per execution route (eager, ``torch_xla.compile``, dynamo) with their
compile counts (the 1x4 child: the forward audit only). Then the trace overhead of xla_tp against
hand-written sharding (``overhead``) and the planning time of a 70B-shaped model (``planning``).

The 1x4 mesh runs in a child process with 4 CPU devices (a torch_xla mesh spans all devices); the
trace overhead and the planning time each in a fresh one (``_fresh``).
Options: ``--quick`` (one model, one width, the 1x8 mesh only, 3 timed steps, 9 trace-overhead rounds, no 70B
planning time), ``--out DIR``.
Example: ``python -m bench --quick --out /tmp/bench``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ["XLA_DUMP_POST_OPTIMIZATIONS"] = "1"  # this is its own process: read partitioned HLO here
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MESHES = {8: ({"model": 8}, {"data": 2, "model": 4}), 4: ({"model": 4},)}
QUICK_STEPS = 3  # timed training steps per execution route with --quick (``timing.STEPS`` otherwise)


def run_meshes(families, widths, meshes, extras: bool = True, steps: Optional[int] = None) -> list[dict]:
    """Every route on every model and mesh; route (e) on the smallest model only (a child each);
    ``extras``: trace times, forward+backward audits and ``steps`` timed training steps too."""
    import xla_tp
    from xla_tp.zoo import registry
    from .auto_sharding import auto_sharding_row
    from .models import smallest
    from .routes import BACKWARD_ROUTES, JAX_ROUTE, ROUTES, mesh_name, run_route
    from .timing import STEPS
    steps = steps or STEPS
    rows, auto_family = [], smallest(families, widths[0])
    for axes in meshes:
        mesh, cache = xla_tp.make_mesh(**axes), {}
        for family in families:
            for width in widths:
                timed = extras and axes is meshes[-1] and width == widths[0]
                new = [run_route(route, family, width, mesh, cache, steps if timed and route in BACKWARD_ROUTES else 0,
                                 extras)
                       for route in [*ROUTES, JAX_ROUTE]]
                if (family, width) == (auto_family, widths[0]):
                    sizes = {"data": axes.get("data", 1), "model": axes["model"]}
                    new.append({"route": "e_xla_auto_sharding", "family": family, "width": registry.WIDTHS[width],
                                "mesh": mesh_name(mesh), **auto_sharding_row(family, width, sizes)})
                for row in new:
                    print(json.dumps({k: v for k, v in row.items() if k != "collectives"}), flush=True)
                rows += new
    return rows


def _fresh(out: Path, name: str, *args: str) -> dict:
    """``python -m bench.<name> --out out *args`` in a fresh process, as a user's script runs (at the end of this
    run's heap, host times read up to twice as long and their ratios drift toward 1), and what it wrote."""
    subprocess.run([sys.executable, "-m", f"bench.{name}", "--out", str(out), *args], check=True)
    return json.loads((out / f"{name}.json").read_text())


def main(argv=None) -> int:
    from .models import FAMILIES, WIDTHS
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="smallest config only")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    families = ("titan_llama",) if args.quick else FAMILIES[1:]
    widths = WIDTHS[:1] if args.quick else WIDTHS
    devices = int(os.environ["CPU_NUM_DEVICES"])
    meshes = MESHES[devices][:1] if args.quick else MESHES[devices]
    if args.child:
        Path(args.child).write_text(json.dumps(run_meshes(families, widths, meshes, extras=False)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_meshes(families, widths, meshes, steps=QUICK_STEPS if args.quick else None)
    if not args.quick:
        import xla_tp
        from .families import family_rows
        rows += family_rows(xla_tp.make_mesh(data=2, model=4))
        child = out / "mesh_1x4.json"
        env = dict(os.environ, CPU_NUM_DEVICES="4")
        subprocess.run([sys.executable, "-m", "bench", "--child", str(child)], env=env, check=True)
        rows += json.loads(child.read_text())
    from .auto_sharding import summary
    from .jax_route import NOTE as JAX_NOTE, ROUTE as JAX_ROUTE
    from .render import CHART, render
    from .overhead import QUICK_TRACES, TRACES
    overhead = _fresh(out, "overhead", "--traces", str(QUICK_TRACES if args.quick else TRACES))
    print("trace overhead (paired medians of the same run):", json.dumps(overhead["ratios"]), flush=True)
    extra = {"e_xla_auto_sharding": summary(rows), JAX_ROUTE: JAX_NOTE,
             f"trace overhead ({overhead['model']}, paired median of {overhead['traces']} interleaved rounds, process CPU time)":
                 json.dumps(overhead["ratios"])}
    if not args.quick:  # a 70B-shaped model traced on meta: seconds, not a smoke run's business
        extra["planning, Llama-3-70B shape on meta"] = json.dumps(_fresh(out, "planning"))
    (out / "routes.json").write_text(json.dumps({"rows": rows, **extra, "trace_overhead": overhead}, indent=1))
    render(rows, out, extra)
    print(f"wrote {out / 'routes.json'}, {out / 'latest.md'}, {out / CHART}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
