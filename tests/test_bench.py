"""``python -m bench --quick``: one model, one width, the 1x8 mesh, route (e) run for real."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


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
    auto = by_route["e_xla_auto_sharding"]  # runs on CPU, but the CPU compiler has no auto-sharding pass
    assert auto["status"] == "ok" and auto["auto_compiles"] == 1, auto
    assert not auto["auto_sharding_pass"] and auto["params_sharded"] == 0, auto
    assert auto["compute_balance"] == 8.0 and auto["collectives"] == {}, auto  # everything replicated
    assert results["e_xla_auto_sharding"].startswith("ran on titan_llama-64")
    _assert_matplotlib_png(tmp_path)


def test_bench_chart_is_a_matplotlib_png(tmp_path):
    from bench.render import render
    rows = [{"route": route, "family": "llama", "width": 64, "mesh": mesh, "status": "ok", "comm_ratio": comm,
             "compute_balance": balance, "param_memory_ratio": balance}
            for mesh in ("1x8", "2x4") for route, comm, balance in
            (("a_xla_tp", 1.0, 1.0), ("b_hand_mark_sharding", None, 1.3), ("g_replicated", 1.0, 8.0))]
    rows.append({"route": "d_torch_parallelize_module", "family": "llama", "width": 64, "mesh": "1x8",
                 "status": "fails: AttributeError: x"})
    render(rows, tmp_path, {})
    _assert_matplotlib_png(tmp_path)


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
