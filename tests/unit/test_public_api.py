"""The public names the README documents are importable from xla_tp itself."""
import torch

import xla_tp
import xla_tp.auditing.hlo  # the audit's package, beside the function


def test_design_names_exist():
    for name in ("make_mesh", "parallelize_xla", "parallelize_module", "plan_for", "audit", "AuditReport",
                 "PlanError", "MeshError", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                 "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_jax",
                 "unparallelize", "layout_of", "generate", "GenerationError"):
        assert hasattr(xla_tp, name), name
    assert issubclass(xla_tp.PlanError, ValueError) and issubclass(xla_tp.MeshError, ValueError)
    assert issubclass(xla_tp.GenerationError, ValueError)


def test_auto_end_to_end_through_the_top_level_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    mesh = xla_tp.make_mesh(model=8)
    plan = xla_tp.plan_for(model, mesh=mesh)
    assert sorted(plan) == ["0", "2"]
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    report = xla_tp.audit(model, torch.randn(8, 16, device=model[0].weight.device), mesh=mesh)
    assert report.count("all-reduce") == 1 and report.count("all-gather") == 0
    assert list(report.collectives["all-reduce"]["axes"]) == ["model"]


def test_every_name_in_the_readmes_table_is_public():
    """The README's one screen of names (its first column) names only what ``xla_tp`` exports."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [line.split("|")[1] for line in readme.splitlines() if line.startswith("| `")]
    names = {m for row in rows for m in re.findall(r"`([a-z_]+)[(`]", row)}
    assert {"parallelize_xla", "torch_plan", "audit", "generate"} <= names
    assert sorted(n for n in names if n not in xla_tp.__all__) == []
