"""Smoke test of ``python -m bench --quick``: one model, one width, the 1x8 mesh."""
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
    rows = json.loads((tmp_path / "routes.json").read_text())["rows"]
    by_route = {r["route"]: r for r in rows}
    assert by_route["a_xla_tp"]["comm_ratio"] == 1.0
    assert by_route["g_replicated"]["compute_balance"] == 8.0
    assert "fails" in by_route["d_torch_parallelize_module"]["status"]
    table = (tmp_path / "latest.md").read_text()
    assert "| titan_llama-64 | 1x8 | a_xla_tp |" in table
    assert (tmp_path / "compute_balance.png").read_bytes().startswith(b"\x89PNG")
