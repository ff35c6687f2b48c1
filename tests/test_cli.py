"""``xla-tp`` command line: mesh parsing, and an audit run end to end in its own process."""
import json
import subprocess
import sys
from pathlib import Path

from xla_tp.cli import parse_mesh


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("") == {}


def test_cli_audit_llama_json():
    result = subprocess.run([sys.executable, "-m", "xla_tp.cli", "audit", "llama", "--mesh", "data=2,model=4",
                             "--json"], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["comm_ratio"] == 1.0 and report["collectives"]["all-reduce"]["count"] == 5
