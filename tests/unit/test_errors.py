"""Every bad input raises a clear error naming the culprit, and leaves the model exactly as it was."""
import numpy as np
import pytest
import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel, PlanError

from ..helpers import MLP, Tied, assert_unchanged, snapshot


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3)
        self.fc1 = nn.Linear(16, 30)
        self.fc2 = nn.Linear(30, 16)


class Fancy(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


CASES = [
    # (model factory, plan, kwargs, error, words the message must contain)
    (lambda: MLP(16, 32), {"fc1": ColwiseParallel(), "fc3": RowwiseParallel()}, {}, PlanError, ["'fc3'", "fc1"]),
    (lambda: MLP(16, 32), {"layers.*.fc2": RowwiseParallel()}, {}, PlanError, ["'layers.*.fc2'", "match no module"]),
    (Conv, {"conv": ColwiseParallel()}, {}, PlanError, ["'conv'", "Conv1d", "nn.Linear"]),
    (lambda: MLP(16, 32), {"fc1": ColwiseParallel()}, {"tp_axis": "expert"}, PlanError, ["'expert'", "axis"]),
    (lambda: MLP(16, 32), {"fc1": "colwize"}, {}, PlanError, ["'fc1'", "'colwize'"]),
    (lambda: MLP(16, 32), {"fc1": Fancy()}, {}, PlanError, ["Fancy", "'fc1'"]),
    (lambda: MLP(16, 32), {"fc1": ColwiseParallel()}, {"backend": "jax"}, PlanError, ["'jax'"]),
    (lambda: MLP(16, 32), [("fc1", ColwiseParallel())], {}, PlanError, ["list"]),
    (lambda: MLP(16, 32), "megatron", {}, PlanError, ["'megatron'", "'auto'"]),
    (lambda: MLP(16, 32), {"re:fc[": ColwiseParallel()}, {}, PlanError, ["'re:fc['", "regular expression"]),
    (lambda: MLP(16, 32), {"fc*": ColwiseParallel(), "re:fc.": RowwiseParallel(), "f?1": RowwiseParallel()}, {},
     PlanError, ["'fc1'", "'fc*'", "'f?1'"]),
]


@pytest.mark.parametrize("factory, plan, kwargs, error, words", CASES)
def test_bad_plan_raises_and_leaves_model_untouched(factory, plan, kwargs, error, words):
    model = factory()
    snap = snapshot(model)
    with pytest.raises(error) as info:
        xla_tp.parallelize_xla(model, plan, mesh=xla_tp.make_mesh(model=8), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_unchanged(model, snap)


def test_auto_without_an_input_to_make_up_waits_for_the_first_call():
    """No input can be made up for a lone Conv1d: plan_for says to pass one; parallelize_xla(model, "auto") does
    not refuse a model that may run, it plans at the model's first call and touches nothing before."""
    model = nn.Sequential(nn.Conv1d(4, 4, 3))
    with pytest.raises(PlanError, match="Sequential.*example_inputs"):
        xla_tp.plan_for(model, mesh={"model": 8})
    with pytest.warns(UserWarning, match="planned and parallelized at its first call"):
        xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(model=8))
    assert model[0].weight.device.type == "cpu"


def test_unmatched_key_suggests_wildcard_fqn():
    model = nn.ModuleDict({"layers": nn.ModuleList([MLP(16, 32) for _ in range(2)])})
    with pytest.raises(PlanError, match=r"did you mean 'layers\.\*\.fc1'"):
        xla_tp.parallelize_xla(model, {"layers.*.fc_1": ColwiseParallel()}, mesh=xla_tp.make_mesh(model=8))


def test_non_strict_skips_unmatched_keys_with_a_warning():
    model = MLP(16, 32)
    with pytest.warns(UserWarning, match="'fc3'"):
        xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel(), "fc3": RowwiseParallel()},
                               mesh=xla_tp.make_mesh(model=8), strict=False)
    assert model.fc1.weight.device.type == "xla"


def test_tied_parameter_with_conflicting_styles():
    model = Tied(32, 16)
    snap = snapshot(model)
    with pytest.raises(PlanError, match=r"'emb.weight' is shared by 'emb' and 'head'"):
        xla_tp.parallelize_xla(model, {"emb": ColwiseParallel(), "head": ColwiseParallel()},
                               mesh=xla_tp.make_mesh(model=8))
    assert_unchanged(model, snap)


def test_meta_module_without_reset_parameters():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(16, 16))
    with torch.device("meta"):
        model = nn.ModuleDict({"raw": Raw(), "fc": nn.Linear(16, 16)})
    with pytest.raises(PlanError, match=r"'raw' \(Raw\) has tensors \['w'\] on the meta device"):
        xla_tp.parallelize_xla(model, {"fc": ColwiseParallel()}, mesh=xla_tp.make_mesh(model=8))
    assert model.fc.weight.is_meta


def test_mesh_without_the_tp_axis():
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "expert"))
    model = MLP(16, 32)
    with pytest.raises(PlanError, match=r"tp_axis 'model' is not an axis of the mesh"):
        xla_tp.parallelize_xla(model, {"fc1": ColwiseParallel()}, mesh=mesh)


def test_not_a_module():
    with pytest.raises(PlanError, match="nn.Module"):
        xla_tp.parallelize_xla(torch.ones(3), {})


REVIEW_CASES = [
    # a spec torch placements cannot say, with the distribute_tensor backend: refused before placing
    (lambda: xla_tp.load_rules({"fc2.weight": [["data", "model"], None]}), {"backend": "distribute_tensor"},
     {"data": 2, "model": 4}, ["'fc2.weight'", "distribute_tensor"]),
    # one axis on two dimensions
    (lambda: xla_tp.load_rules({"fc2.weight": ["model", "model"]}), {}, {"model": 8}, ["'fc2.weight'", "more than one"]),
    # an activation rule naming an axis the mesh lacks
    (lambda: xla_tp.load_rules({"fc1": ["bogus", None]}), {}, {"model": 8}, ["'fc1'", "'bogus'"]),
]


@pytest.mark.parametrize("make_plan, kwargs, axes, words", REVIEW_CASES)
def test_specs_are_checked_before_anything_moves(make_plan, kwargs, axes, words):
    model = MLP(16, 32)
    snap = snapshot(model)
    with pytest.raises(PlanError) as info:
        xla_tp.parallelize_xla(model, make_plan(), mesh=xla_tp.make_mesh(**axes), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_unchanged(model, snap)


def test_explicit_fsdp_rule_is_not_sharded_twice():
    model = MLP(16, 32)
    mesh = xla_tp.make_mesh(fsdp=2, model=4)
    xla_tp.parallelize_xla(model, xla_tp.load_rules({"fc1.weight": ["fsdp", None]}), mesh=mesh)
    from ..helpers import expected_sharding, sharding
    assert sharding(model.fc1.weight) == expected_sharding((32, 16), mesh, ("fsdp", None))


def test_unnamed_2d_mesh_is_refused():
    from torch.distributed.device_mesh import DeviceMesh
    with pytest.raises(xla_tp.MeshError, match="needs axis names"):
        xla_tp.parallelize_module(MLP(16, 32), DeviceMesh("xla", torch.arange(8).reshape(2, 4)),
                                  {"fc1": ColwiseParallel()})
