"""``python -m bench --quick``: one model, one width, the 1x8 mesh, route (e) run for real."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.overhead import QUICK_TRACES

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_writes_json_markdown_and_chart(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_DUMP_POST_OPTIMIZATIONS"}
    env["CPU_NUM_DEVICES"] = "8"
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "routes.json").read_text())
    rows = results["rows"]
    by_route = {r["route"]: r for r in rows}
    assert by_route["a_xla_tp"]["comm_ratio"] == 1.0
    assert by_route["g_replicated"]["compute_balance"] == 8.0
    assert "fails" in by_route["d_torch_parallelize_module"]["status"]
    jax_route = by_route["f_jax_torchax"]  # the same plan compiled by JAX agrees with route (a)
    assert jax_route["status"] == "ok", jax_route
    assert (jax_route["comm_ratio"], jax_route["all_gathers"]) == (1.0, 0)
    assert jax_route["compute_balance"] == by_route["a_xla_tp"]["compute_balance"]
    table = (tmp_path / "latest.md").read_text()
    assert "| titan_llama-64 | 1x8 | a_xla_tp |" in table
    assert (by_route["a_xla_tp"]["comm_ratio_bwd"], by_route["a_xla_tp"]["all_gathers_bwd"]) == (1.0, 0)
    for route in ("a_xla_tp", "b_hand_mark_sharding", "g_replicated"):  # trace and step times, same run
        row = by_route[route]
        for key in ("trace_fwd", "trace_fwdbwd"):
            assert 0 < row[key]["min"] <= row[key]["median"] <= row[key]["max"], (route, row[key])
        assert set(row["steps"]) == {"eager", "torch_xla.compile", "dynamo"}, row["steps"]
        for execution, s in row["steps"].items():
            assert s.get("compiles") == 0 and s["warmup_compiles"] >= 1, (route, execution, s)  # none after warm-up
    assert "## Training steps" in table and "compiles 1 + 0" in table
    overhead = results["trace_overhead"]
    assert overhead["traces"] == QUICK_TRACES and set(overhead["ratios"]) == {
        "xla_tp / hand (torch plan)", "xla_tp / hand (torch plan, 4 kv heads)", "xla_tp / hand (SP plan)",
        "xla_tp (SP plan) / none", "hand (SP plan) / none"}
    assert all(0.5 < v < 3 for v in overhead["ratios"].values()), overhead["ratios"]
    auto = by_route["e_xla_auto_sharding"]  # runs on CPU, but the CPU compiler has no auto-sharding pass
    assert auto["status"] == "ok" and auto["auto_compiles"] == 1, auto
    assert not auto["auto_sharding_pass"] and auto["params_sharded"] == 0, auto
    assert auto["compute_balance"] == 8.0 and auto["collectives"] == {}, auto  # everything replicated
    assert results["e_xla_auto_sharding"].startswith("ran on titan_llama-64")
    _assert_matplotlib_png(tmp_path)


def test_bench_chart_is_a_matplotlib_png(tmp_path):
    from bench.render import render
    def timed(median):
        return {"median": median, "min": 0.8 * median, "max": 1.3 * median}

    rows = [{"route": route, "family": "llama", "width": 64, "mesh": mesh, "status": "ok", "comm_ratio": comm,
             "comm_ratio_bwd": comm, "compute_balance": balance, "param_memory_ratio": balance,
             "trace_fwdbwd": timed(t), "steps": {e: {**timed(t), "warmup_compiles": 1, "compiles": 0}
                                                for e in ("eager", "torch_xla.compile", "dynamo")}}
            for mesh in ("1x8", "2x4") for route, comm, balance, t in
            (("a_xla_tp", 1.0, 1.0, 0.02), ("b_hand_mark_sharding", None, 1.3, 0.01), ("g_replicated", 1.0, 8.0, 0.03))]
    rows.append({"route": "d_torch_parallelize_module", "family": "llama", "width": 64, "mesh": "1x8",
                 "status": "fails: AttributeError: x"})
    render(rows, tmp_path, {})
    _assert_matplotlib_png(tmp_path)
    a = next(r for r in rows if r["route"] == "a_xla_tp")
    assert a["trace_x"] == pytest.approx(2 / 3) and a["step_x_dynamo"] == pytest.approx(2 / 3)
    assert (a["trace_x_min"], a["trace_x_max"]) == (pytest.approx(0.8 * 2 / 3), pytest.approx(1.3 * 2 / 3))
    from PIL import Image
    assert Image.open(tmp_path / "routes.png").height >= 8 * 400  # a row of panels per metric: audits, trace, steps


def _assert_matplotlib_png(out_dir: Path) -> None:
    """The chart under ``out_dir`` is a sizeable PNG that matplotlib drew, linked from latest.md."""
    from PIL import Image

    from bench.render import CHART
    png = out_dir / CHART
    image = Image.open(png)
    assert image.format == "PNG" and image.width >= 1000 and image.height >= 800
    assert png.stat().st_size > 30_000  # text, bars, legend: not a blank canvas
    assert "matplotlib" in image.info.get("Software", "").lower()
    assert len(image.convert("RGB").getcolors(1 << 20)) > 50  # bars in several colours, anti-aliased text
    assert f"]({CHART})" in (out_dir / "latest.md").read_text()



def test_hand_written_plans_split_every_projection_they_name():
    """The families table's hand route for a family without a published tp_plan: every key of its
    hand-written plan names modules of the family's tiny model, and each of them has its weight split."""
    from types import SimpleNamespace

    from bench.families import HAND_PLANS, build
    from bench.plans import plan_layout
    from xla_tp.plan.hf import hf_plan
    from xla_tp.plan.match import match_keys
    mesh = SimpleNamespace(axis_names=("data", "model"), mesh_shape=(2, 4))
    for family, plan in HAND_PLANS.items():
        model = build(family)[0]
        assert not hf_plan(model), f"{family} publishes a tp_plan now: use it, drop the hand one"
        found, unused = match_keys(list(plan), [n for n, _ in model.named_modules()])
        assert found and not unused, (family, unused)
        specs = plan_layout(model, plan, mesh).params
        assert all("model" in specs[f"{name}.weight"] for name in found), (family, specs)
