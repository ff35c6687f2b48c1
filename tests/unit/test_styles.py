"""Each torch style puts each parameter where torch's style.py says, as a plain XLA Parameter."""
import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

import xla_tp
from xla_tp import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                    Replicate, RowwiseParallel, SequenceParallel, Shard)

from xla_tp.state import record_of

from ..helpers import MLP, expected_sharding, sharding


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_col = nn.Embedding(32, 16)
        self.emb_row = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.mlp = MLP(16, 32)

    def forward(self, ids):
        return self.mlp(self.norm(self.emb_col(ids) + self.emb_row(ids)))


PLAN = {"emb_col": ColwiseParallel(), "emb_row": RowwiseParallel(), "norm": SequenceParallel(),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
EXPECTED = {"emb_col.weight": (None, "model"), "emb_row.weight": ("model", None),
            "norm.weight": (None,), "norm.bias": (None,),
            "mlp.fc1.weight": ("model", None), "mlp.fc1.bias": ("model",),
            "mlp.fc2.weight": (None, "model"), "mlp.fc2.bias": (None,)}


@pytest.mark.parametrize("axes", [{"model": 8}, {"data": 2, "model": 4}])
@pytest.mark.parametrize("backend", ["mark_sharding", "distribute_tensor"])
def test_placements_follow_the_style(axes, backend):
    mesh = xla_tp.make_mesh(**axes)
    model = xla_tp.parallelize_xla(Tower(), PLAN, mesh=mesh, backend=backend)
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and type(p.data) is torch.Tensor, name
        assert p.device.type == "xla", name
        assert sharding(p) == expected_sharding(p.shape, mesh, EXPECTED[name]), name


def test_style_subclass_lowers_like_its_base():
    class MyColwise(ColwiseParallel):
        pass
    mesh = xla_tp.make_mesh(model=8)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": MyColwise(), "fc2": RowwiseParallel()}, mesh=mesh)
    assert sharding(model.fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))


def test_linear_subclass_is_sharded():
    class MyLinear(nn.Linear):
        pass
    mesh = xla_tp.make_mesh(model=8)
    mod = nn.Sequential(MyLinear(16, 32))
    xla_tp.parallelize_xla(mod, {"0": ColwiseParallel()}, mesh=mesh)
    assert sharding(mod[0].weight) == expected_sharding((32, 16), mesh, ("model", None))


class Recorder(nn.Module):
    """Records the sharding of what reaches its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seen = {}

    def forward(self, x, y=None):
        self.seen = {"x": sharding(x), "y": sharding(y) if y is not None else None}
        return self.lin(x), x * 2


def test_prepare_module_input_positional_and_kwargs():
    mesh = xla_tp.make_mesh(model=8)
    rec = Recorder()
    style = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
                               input_kwarg_layouts={"y": Replicate()}, desired_input_kwarg_layouts={"y": Shard(1)})
    xla_tp.parallelize_xla(rec, {"": style}, mesh=mesh)
    dev = rec.lin.weight.device
    rec(torch.randn(8, 16, device=dev), y=torch.randn(8, 16, device=dev))
    assert rec.seen["x"] == expected_sharding((8, 16), mesh, (None, None))
    assert rec.seen["y"] == expected_sharding((8, 16), mesh, (None, "model"))


def test_prepare_module_output_and_input_output():
    mesh = xla_tp.make_mesh(model=8)
    for style in (PrepareModuleOutput(output_layouts=(Replicate(), Replicate()),
                                      desired_output_layouts=(Shard(0), Shard(1))),
                  PrepareModuleInputOutput(input_layouts=None, desired_input_layouts=None,
                                           output_layouts=(Replicate(), Replicate()),
                                           desired_output_layouts=(Shard(0), Shard(1)))):
        rec = Recorder()
        xla_tp.parallelize_xla(rec, style, mesh=mesh)
        a, b = rec(torch.randn(8, 16, device=rec.lin.weight.device))
        assert sharding(a) == expected_sharding((8, 16), mesh, ("model", None))
        assert sharding(b) == expected_sharding((8, 16), mesh, (None, "model"))


def test_sequence_parallel_constrains_input_and_output():
    mesh = xla_tp.make_mesh(data=2, model=4)
    norm = nn.LayerNorm(16)
    seen = {}
    xla_tp.parallelize_xla(norm, SequenceParallel(), mesh=mesh)
    norm.register_forward_pre_hook(lambda m, a: seen.update(inp=sharding(a[0])))  # runs after ours
    out = norm(torch.randn(2, 8, 16, device=norm.weight.device))
    want = expected_sharding((2, 8, 16), mesh, ("data", "model", None))
    assert seen["inp"] == want and sharding(out) == want


def test_nested_plan_parent_and_children():
    """A PrepareModuleInput on a parent and Colwise/Rowwise on its children both apply."""
    mesh = xla_tp.make_mesh(model=8)
    model = nn.ModuleDict({"block": MLP(16, 32)})
    seen = {}
    plan = {"block": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate()),
            "block.fc1": ColwiseParallel(), "block.fc2": RowwiseParallel()}
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    model["block"].register_forward_pre_hook(lambda m, a: seen.update(inp=sharding(a[0])))
    model["block"](torch.randn(8, 16, device=model["block"].fc1.weight.device))
    assert seen["inp"] == expected_sharding((8, 16), mesh, (None, None))
    assert sharding(model["block"].fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))


def test_wildcards_match_per_segment_like_torch():
    mesh = xla_tp.make_mesh(model=8)
    model = nn.ModuleDict({f"l{i}": MLP(16, 32) for i in range(3)})
    xla_tp.parallelize_xla(model, {"l*.fc1": ColwiseParallel(), "l[01].fc2": RowwiseParallel()}, mesh=mesh)
    for i in range(3):
        assert sharding(model[f"l{i}"].fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))
    assert sharding(model["l1"].fc2.weight) == expected_sharding((16, 32), mesh, (None, "model"))
    assert "devices" not in sharding(model["l2"].fc2.weight)


def test_regex_key_and_exact_beats_wildcard():
    mesh = xla_tp.make_mesh(model=8)
    model = nn.ModuleDict({f"l{i}": MLP(16, 32) for i in range(2)})
    plan = {r"re:l\d\.fc1": ColwiseParallel(), "l*.fc2": RowwiseParallel(), "l1.fc2": ColwiseParallel()}
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    assert sharding(model["l0"].fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))
    assert sharding(model["l0"].fc2.weight) == expected_sharding((16, 32), mesh, (None, "model"))
    assert sharding(model["l1"].fc2.weight) == expected_sharding((16, 32), mesh, ("model", None))


def test_fsdp_axis_shards_the_free_dimension():
    mesh = xla_tp.make_mesh(fsdp=2, model=4)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    assert sharding(model.fc1.weight) == expected_sharding((32, 16), mesh, ("model", "fsdp"))
    assert sharding(model.fc2.weight) == expected_sharding((16, 32), mesh, ("fsdp", "model"))
    assert sharding(model.fc2.bias) == expected_sharding((16,), mesh, ("fsdp",))


def test_torch_parallelize_module_signature_is_drop_in():
    from torch.distributed.device_mesh import DeviceMesh
    model = MLP(16, 32)
    out = xla_tp.parallelize_module(model, DeviceMesh("xla", list(range(8))),
                                    {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    assert out is model
    import torch_xla.distributed.spmd as xs
    mesh = xs.Mesh(list(range(8)), (8,), ("model",))
    assert sharding(model.fc2.weight) == expected_sharding((16, 32), mesh, (None, "model"))


def test_parallelizing_again_replaces_the_previous_hooks():
    mesh = xla_tp.make_mesh(model=8)
    model = MLP(16, 32)
    xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    xla_tp.parallelize_xla(model, {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}, mesh=mesh)
    assert len(model.fc1._forward_pre_hooks) == 1 and len(model.fc1._forward_hooks) == 1
    assert sharding(model.fc1.weight) == expected_sharding((32, 16), mesh, (None, "model"))


def test_parallelizing_again_forgets_shardings_the_new_plan_leaves_out():
    mesh = xla_tp.make_mesh(model=8)
    model = MLP(16, 32)
    xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    xla_tp.parallelize_xla(model, {"fc2": RowwiseParallel()}, mesh=mesh)
    assert "devices" not in sharding(model.fc1.weight)
    assert record_of(model.fc1.weight) is None


def _titan(name: str, module: str, base: type = ParallelStyle, **attrs) -> type:
    """A class with torchtitan 0.2's identity (module and name): what its ``parallelize`` functions pass."""
    return type(name, (base,), {"__module__": module, "_apply": lambda self, m, mesh: m, **attrs})


def test_other_libraries_styles_lower_by_registration():
    from torch.distributed.tensor.placement_types import Partial
    from xla_tp.plan.normalize import build_layout
    no_parallel = _titan("NoParallel", "torchtitan.distributed",
                         __init__=lambda self, use_local_output=True: setattr(self, "output_layout", Replicate()))
    expert_parallel = _titan("ExpertParallel", "torchtitan.distributed.expert_parallel")
    expert_tp = _titan("ExpertTensorParallel", "torchtitan.distributed.expert_parallel", base=expert_parallel)
    tensor_parallel = _titan("TensorParallel", "torchtitan.distributed.expert_parallel")

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Parameter(torch.zeros(8, 32, 16)), nn.Parameter(torch.zeros(8, 32, 16))
            self.w2 = nn.Parameter(torch.zeros(8, 16, 32))

    model = nn.ModuleDict({"gate": nn.Linear(16, 8), "a": Experts(), "b": Experts(), "c": Experts()})
    plan = {"gate": no_parallel(use_local_output=False), "a": expert_parallel(), "b": expert_tp(), "c": tensor_parallel()}
    layout = build_layout(model, plan, {"data": 2, "expert": 2, "model": 4}, "model")
    assert layout.params["gate.weight"] == (None, None) and layout.modules["gate"].inputs == ((Replicate(),),)
    assert layout.params["a.w2"] == ("model", None, None)
    assert layout.params["b.w1"] == ("expert", "model", None) and layout.params["b.w2"] == ("expert", None, "model")
    assert layout.params["c.w1"] == (None, "model", None) and layout.params["c.w2"] == (None, None, "model")
    assert layout.modules["c"].natural_output == Partial()
    mine = _titan("Mine", "somewhere.else")
    with pytest.raises(xla_tp.PlanError, match=r"register_style\(Mine"):
        build_layout(model, {"gate": mine()}, {"model": 4}, "model")
    xla_tp.register_style(mine, lambda style, module: xla_tp.ShardParams({"weight": ("tp", None)}))
    assert build_layout(model, {"gate": mine()}, {"model": 4}, "model").params["gate.weight"] == ("model", None)
