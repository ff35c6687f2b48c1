"""Every order a torch user writes, each in a fresh process (a segmentation fault fails the test).

torch users move the model to the device before they build the mesh. Each script imports xla_tp at
the top, as a script does, puts the model (and another tensor) on the XLA device, then builds the
mesh one way or another; the parallelized model must match the CPU model, and the tensor created
before the mesh must still compute. The one order torch_xla cannot run (the device used before
xla_tp is imported) raises ``MeshError`` and leaves the earlier tensor working.
"""
import pytest

from ..fresh import run_fresh

SETUP = """
import copy, torch, torch_xla
import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
torch.manual_seed(0)
cpu = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
x = torch.randn(4, 16)
device = torch_xla.device()
early = torch.arange(3.0, device=device)      # any tensor on the device before the mesh
model = copy.deepcopy(cpu).to(device)         # torch's order: the model first, then the mesh
"""

CHECK = """
out = model(x.to(device))
out.sum().backward()
reference = cpu(x)
reference.sum().backward()                    # the CPU backward after XLA ran (the CPU-backward trap)
print("out", (out.cpu() - reference).abs().max().item())
print("grad", (model[0].weight.grad.cpu() - cpu[0].weight.grad).abs().max().item())
print("spec", torch_xla._XLAC._get_xla_sharding_spec(model[0].weight))
print("early", (early * 2).cpu().tolist())
"""

ORDERS = {
    "make_mesh": "model = xla_tp.parallelize_xla(model, plan, mesh=xla_tp.make_mesh(data=2, model=4))",
    "init_device_mesh": ("world = xla_tp.init_device_mesh('xla', (2, 4), mesh_dim_names=('dp', 'tp'))\n"
                         "model = xla_tp.parallelize_module(model, world['tp'], plan)"),
    "no_mesh": "model = xla_tp.parallelize_xla(model, plan)",
    "auto": "model = xla_tp.parallelize_xla(model, 'auto')",
}


def parse(out: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in
                ("out", "grad", "spec", "early", "error"))


@pytest.mark.parametrize("order", [pytest.param(o, marks=pytest.mark.complete) if o in ("auto", "init_device_mesh")
                                   else o for o in sorted(ORDERS)])  # a fresh process each: two in the quick tier
def test_model_on_the_device_before_the_mesh_matches_cpu(order):
    seen = parse(run_fresh(SETUP + ORDERS[order] + "\n" + CHECK))
    assert float(seen["out"]) < 1e-5 and float(seen["grad"]) < 1e-5, seen
    assert seen["spec"].startswith("{devices=["), seen      # the weight really is sharded
    assert seen["early"] == "[0.0, 2.0, 4.0]"


def test_device_used_before_import_raises_mesh_error_and_keeps_the_tensor():
    script = """
import torch, torch_xla
early = torch.arange(3.0, device=torch_xla.device())   # before xla_tp is imported: SPMD cannot follow
import xla_tp
try:
    xla_tp.make_mesh(model=8)
except xla_tp.MeshError as error:
    print("error", error)
print("early", (early * 2).cpu().tolist())
"""
    seen = parse(run_fresh(script))
    assert "before the first XLA tensor" in seen["error"] and "Import xla_tp" in seen["error"], seen
    assert seen["early"] == "[0.0, 2.0, 4.0]"
