"""``audit`` in a process that cannot read partitioned HLO replays the module in a fresh one."""
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os, torch, torch_xla, xla_tp
from tests.helpers import MLP
assert "XLA_DUMP_POST_OPTIMIZATIONS" not in os.environ
mesh = xla_tp.make_mesh(data=2, model=4)
plan = {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()}
model = xla_tp.parallelize_xla(MLP(16, 32, bias=False), plan, mesh=mesh)
from xla_tp.audit import audit
report = audit(model, torch.randn(8, 16).to(torch_xla.device()), mesh=mesh)
assert "XLA_DUMP_POST_OPTIMIZATIONS" not in os.environ
print(report.comm_ratio, report.compute_balance, report.count("all-reduce"))
"""


def test_audit_without_post_optimization_flag_uses_a_fresh_process():
    import os
    env = {k: v for k, v in os.environ.items() if k != "XLA_DUMP_POST_OPTIMIZATIONS"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=Path(__file__).parent.parent, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["1.0", "1.0", "1"]
