"""The JAX backend's bad input: clear errors, and the model exactly as it was."""
import copy

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel, ShardParams
from xla_tp.zoo import registry

from ..helpers import MLP
from ..helpers_jax import ensure_cpu_devices  # noqa: F401  (jax's 8 devices first)
from ..looped_moe import Decoder, OneHotMoe


@pytest.mark.parametrize("mesh, message", [
    ({"modle": 8}, "unknown"), ({"model": 16}, "needs 16 devices but jax has 8"),
    ({"model": 2.0}, "positive ints"), ({"tp": 4, "model": 2}, "given twice"), ("model", "jax.sharding.Mesh"),
])
def test_bad_meshes(mesh, message):
    with pytest.raises(xla_tp.MeshError, match=message):
        xla_tp.parallelize_jax(MLP(), {"fc1": ColwiseParallel()}, mesh=mesh)


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, model.config._attn_implementation,
            [n for n, m in model.named_modules() if "forward" in vars(m)])


@pytest.mark.parametrize("plan, message", [
    ({"model.layers.*.self_attn.q_projj": "colwise"}, "did you mean"),
    ({"model.layers.*.mlp.down_proj": RowwiseParallel(), "model.norm": ColwiseParallel()}, "LlamaRMSNorm"),
    ({"model.layers.*.self_attn.q_proj": ShardParams({"weight": ("model", None, None)})}, "has 2 dims"),
])
def test_plan_errors_leave_the_model_as_it_was(plan, message):
    model = registry.build("llama")
    before = _snapshot(model)
    with pytest.raises(xla_tp.PlanError, match=message):
        xla_tp.parallelize_jax(model, plan, mesh={"model": 8})
    after = _snapshot(model)
    assert after[1:] == before[1:]
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())


def test_an_unknown_outputs_choice_is_refused_before_anything_changes():
    model = registry.build("llama")
    before = _snapshot(model)
    with pytest.raises(xla_tp.PlanError, match="outputs='rows'; pass 'global'"):
        xla_tp.parallelize_jax(model, "auto", mesh={"model": 8}, outputs="rows")
    after = _snapshot(model)
    assert after[1:] == before[1:] and all(torch.equal(after[0][k], v) for k, v in before[0].items())


def test_one_process_holds_every_row():
    jm = xla_tp.parallelize_jax(MLP(), "auto", mesh={"data": 2, "model": 4}, outputs="process")
    assert jm.process_slice(8) == slice(0, 8) and jm.processes == 1
    x = torch.randn(8, 16)
    torch.testing.assert_close(jm(jm.process_rows(x)), jm(x))


def test_meta_model_is_refused_before_anything_changes():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(xla_tp.PlanError, match="meta device"):
        xla_tp.parallelize_jax(model, "auto", mesh={"model": 8})


def test_a_jax_mesh_with_aliased_axis_names():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("dp", "tp"))
    jm = xla_tp.parallelize_jax(MLP(16, 64), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    assert jm.mesh.axis_names == ("data", "model")
    assert jm.params["fc1.weight"].sharding.spec == ("model", None)
    x = torch.randn(8, 16)
    assert jm(x).shape == (8, 16)
    assert torch.equal(jm(x.numpy()), jm(x))  # numpy arrays are inputs too


def test_arguments_and_outputs_that_cannot_cross_jit():
    model = registry.build("llama")
    jm = xla_tp.parallelize_jax(copy.deepcopy(model), "auto", mesh={"model": 8})
    tokens = registry.example_input("llama")
    with pytest.raises(TypeError, match="cannot be passed to a jitted model"):
        jm(tokens, labels=object())
    with pytest.raises(TypeError, match="use_cache=False"):
        jm(tokens, use_cache=True)


def test_experts_picked_by_torch_where_are_refused_naming_the_module_and_the_backend_that_runs_them():
    model = Decoder(OneHotMoe, layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(xla_tp.PlanError, match=r"parallelize_jax: moes.0 picks its experts' tokens with torch.where"
                                                r".*parallelize it with parallelize_xla"):
        xla_tp.parallelize_jax(model, "auto", mesh={"data": 2, "model": 4})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert xla_tp.state_of(model) is None
