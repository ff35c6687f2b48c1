"""What a pod's user types: ``--print-commands`` beside gcloud for GKE (xpk), a multi-slice topology's
commands (one queued resource, a node per slice), its dry run (data over DCN) and the fit check's
suggestions keeping the data axis across the slices."""
import subprocess
import sys
from pathlib import Path

import pytest

import xla_tp
from xla_tp import cli
from xla_tp.launch import load_recipe, load_topology
from xla_tp.launch.fit import FitSettings, estimate, suggest
from xla_tp.launch.model import build_model, hf_config, model_shape
from xla_tp.launch.plans import plan_input, plan_specs
from xla_tp.launch.session import estimator

from ..fresh import user_env
from .test_launch_fit import RULES, TINY

ROOT = Path(__file__).resolve().parents[2]
INNER = "'cd ~/xla_tp && PJRT_DEVICE=TPU xla-tp launch llama3-8b --topology {} batch={}'"


def _commands(capsys, topology: str, batch: int) -> list[str]:
    assert cli.main(["launch", "llama3-8b", "--topology", topology, "--print-commands", "--tpu-name", "pod",
                     "--zone", "z", f"batch={batch}"]) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_print_commands_give_the_xpk_workload_beside_gcloud(capsys):
    lines = _commands(capsys, "v5p-32", 16)
    inner = INNER.format("v5p-32", 16)
    assert (f'# GKE (xpk): xpk workload create --cluster "$CLUSTER" --workload xla-tp-llama3-8b --tpu-type=v5p-32 '
            f'--num-slices=1 --docker-image "$IMAGE" --command={inner}') in lines
    assert [line for line in lines if not line.startswith("#")] == [
        f"gcloud compute tpus tpu-vm ssh pod --zone=z --worker={i} --command={inner}" for i in range(4)]


def test_a_multislice_topology_is_one_queued_resource_with_a_node_per_slice(capsys):
    lines = _commands(capsys, "v5e-256x2", 256)
    inner = INNER.format("v5e-256x2", 256)
    assert lines[0].startswith("# v5e-256x2 (2 x v5litepod-256): 2 slices x 64 TPU VM worker(s) x 4 chips = 512 chips")
    assert f"# All at once: gcloud compute tpus queued-resources ssh pod --zone=z --node=all --worker=all " \
           f"--command={inner}" in lines
    assert any(line.startswith("# GKE (xpk): ") and "--tpu-type=v5litepod-256 --num-slices=2 " in line for line in lines)
    assert [line for line in lines if not line.startswith("#")] == [
        f"gcloud compute tpus queued-resources ssh pod --zone=z --node={n} --worker=all --command={inner}"
        for n in range(2)]


def test_a_multislice_mesh_must_put_data_across_the_slices(capsys):
    assert cli.main(["launch", "llama3-8b", "--topology", "v5e-256x2", "--dry-run", "batch=256",
                     "mesh={fsdp: 128, model: 4}"]) == 2
    err = capsys.readouterr().err
    assert "data=1 must be a multiple of the 2 slices" in err and err.count("\n") == 1


def test_suggestions_keep_the_data_axis_across_the_slices():
    recipe = load_recipe("tiny-llama-cpu", TINY)
    recipe.plan = RULES                                   # a rule plan: each mesh tried is planned quickly
    config = hf_config(recipe.model, recipe.path)
    shape, meta = model_shape(config), build_model(config, "causal-lm", device="meta")
    mesh = xla_tp.make_mesh(data=2, model=4)
    planned = plan_specs(meta, plan_input(recipe), mesh)
    settings = FitSettings("fp32", "adamw", 0.0, 1024, 16, False)
    topo = load_topology("v5e-8")
    report = estimate(meta, planned.specs, mesh, shape, settings, topo)
    two = type(topo)(**{**vars(topo), "slices": 2, "hbm_gib_per_chip": report.total * 0.8 / 2**30 / 0.9})
    each = estimator(meta, plan_input(recipe), shape, settings, two)
    report = estimate(meta, planned.specs, mesh, shape, settings, two)
    meshes = [tip[:tip.index("}") + 1] for tip in suggest(report, shape, 8, each, slices=2) if tip.startswith("mesh=")]
    one = [tip[:tip.index("}") + 1] for tip in suggest(report, shape, 8, each) if tip.startswith("mesh=")]
    assert meshes == ["mesh={data: 2, fsdp: 4}"] and one == ["mesh={fsdp: 8}"]


@pytest.mark.complete
def test_a_multislice_dry_run_says_data_crosses_the_slices():
    run = subprocess.run([sys.executable, "-m", "xla_tp.cli", "launch", "llama3-8b", "--topology", "v5p-64x2",
                          "--dry-run", "batch=32"], cwd=ROOT, env=user_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "v5p-64x2 (64 chips, 16 host(s), 2 slices: data=2 over DCN), mesh data=2,fsdp=8,model=4" in run.stdout
    assert "=> fits" in run.stdout and "nothing was allocated or compiled" in run.stdout
