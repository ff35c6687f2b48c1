"""``xla-tp`` command line: mesh parsing, an audit end to end, and bad input (one line, status 2), in
fresh processes as a user runs it (the bad-input cases share one, each with its own stderr)."""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.cli import parse_mesh

from ..fresh import user_env
from ..helpers import MLP


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("") == {}


def test_cli_audit_llama_json():
    result = subprocess.run([sys.executable, "-m", "xla_tp.cli", "audit", "llama", "--mesh", "data=2,model=4",
                             "--json"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["comm_ratio"] == 1.0 and report["collectives"]["all-reduce"]["count"] == 5


ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``xla-tp ARGS`` as a user runs it: a fresh process, only the device variables set."""
    return subprocess.run([sys.executable, "-m", "xla_tp.cli", *args], cwd=ROOT, env=user_env(), capture_output=True,
                          text=True, timeout=300)


BAD_INPUT = {
    "audit, unknown mesh axis": (["audit", "llama", "--mesh", "data=2,modle=4"], "xla-tp audit: make_mesh: unknown axis 'modle'"),
    "plan, unknown mesh axis": (["plan", "llama", "--mesh", "foo=8"], "xla-tp plan: make_mesh: unknown axis 'foo'"),
    "mesh size not a number": (["audit", "llama", "--mesh", "model=x"], "'model=x' is not name=size"),
    "batch 0": (["audit", "llama", "--batch", "0"], "xla-tp audit: --batch 0: pass a positive number"),
    "batch not an int": (["plan", "llama", "--batch", "x"], "argument --batch: invalid int value: 'x'"),
    "config path not JSON": (["audit", "README.md"], "README.md: not a Hugging Face config.json"),
    "unknown model": (["plan", "lama"], "unknown model 'lama'"),
    "binary recipe": (["launch", "{binary}", "--dry-run"], "not a YAML text file"),
    "missing data, dry run": (["launch", "data.path=/nonexistent.txt", "--dry-run"],
                              "xla-tp launch: data.path '/nonexistent.txt': no such file"),
}


BAD_INPUT_RUN = r"""
import json, os, sys

def run(argv, load):
    # one case as a user runs it: its status and everything written to stderr (fd 2, C writes included)
    err, saved = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_TRUNC), os.dup(2)
    os.dup2(err, 2)
    try:
        code = load()(argv)
    except SystemExit as stop:
        code = stop.code
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.lseek(err, 0, 0)
    text = os.read(err, 1 << 20).decode(errors="replace")
    os.close(err)
    return code, text

def load():  # the first case imports xla_tp under the redirect too: what importing prints is counted
    from xla_tp.cli import main
    return main

print(json.dumps({name: run(argv, load) for name, argv in json.loads(sys.argv[1]).items()}))
"""


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every BAD_INPUT case in one fresh process (only the device variables set), each with its own stderr."""
    where = tmp_path_factory.mktemp("bad_input")
    binary = where / "recipe.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    cases = {case: [a.format(binary=binary) for a in args] for case, (args, _) in BAD_INPUT.items()}
    result = subprocess.run([sys.executable, "-c", BAD_INPUT_RUN, json.dumps(cases), str(where / "case.err")], cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_with_the_fix_and_status_2(case, bad_input_runs):
    code, stderr = bad_input_runs[case]
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr[-3000:]
    assert BAD_INPUT[case][1] in lines[0] and lines[0].startswith("xla-tp"), lines[0]


def test_audit_warns_when_the_batch_does_not_divide_over_the_data_axis():
    result = _cli("audit", "mlp", "--batch", "3", "--mesh", "data=2,model=4")
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if line.startswith(
        "xla-tp audit: warning: batch 3 does not divide over data=2 (2 devices): its inputs are whole on every device")]
    assert len(warned) == 1, result.stderr[-3000:]
    assert "dot FLOPs x devices" in result.stdout          # the report is still printed


def test_python_audit_warns_the_same_way():
    model = MLP(16, 32)
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()}, mesh=mesh)
    with pytest.warns(UserWarning, match="batch 3 does not divide over data=2"):
        xla_tp.audit(model, torch.randn(3, 16, device=torch_xla.device()), mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        xla_tp.audit(model, torch.randn(4, 16, device=torch_xla.device()), mesh=mesh)
