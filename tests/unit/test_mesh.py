import numpy as np
import pytest
import torch
import torch_xla.distributed.spmd as xs
from torch.distributed.device_mesh import DeviceMesh

import xla_tp
from xla_tp.mesh import to_xs_mesh


def test_make_mesh_named_axes_and_global():
    mesh = xla_tp.make_mesh(data=2, model=4)
    assert tuple(mesh.axis_names) == ("data", "fsdp", "model")
    assert tuple(mesh.mesh_shape) == (2, 1, 4)
    assert xs.get_global_mesh() is mesh


@pytest.mark.parametrize("axes, shape", [
    ({"tp": 8}, (1, 1, 8)),
    ({"dp": 2, "tensor": None}, (2, 1, 4)),
    ({"fsdp": 2, "model": 4}, (1, 2, 4)),
    ({}, (1, 1, 8)),
])
def test_make_mesh_aliases_and_leftover(axes, shape):
    assert tuple(xla_tp.make_mesh(**axes).mesh_shape) == shape


def test_make_mesh_wrong_product_names_both_numbers():
    with pytest.raises(xla_tp.MeshError, match=r"multiply to 12 but there are 8 devices"):
        xla_tp.make_mesh(data=3, model=4)


def test_make_mesh_unknown_axis():
    with pytest.raises(xla_tp.MeshError, match="'pipeline'"):
        xla_tp.make_mesh(pipeline=2, model=4)


def test_the_expert_axis_is_in_a_mesh_only_when_asked_for():
    assert tuple(xla_tp.make_mesh(data=2, model=4).axis_names) == ("data", "fsdp", "model")
    mesh = xla_tp.make_mesh(ep=2, model=4)
    assert (tuple(mesh.axis_names), tuple(mesh.mesh_shape)) == (("data", "fsdp", "expert", "model"), (1, 1, 2, 4))


def test_device_mesh_conversion():
    one_d = to_xs_mesh(DeviceMesh("xla", list(range(8))))
    assert tuple(one_d.axis_names) == ("model",) and tuple(one_d.mesh_shape) == (8,)
    named = to_xs_mesh(DeviceMesh("xla", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp")))
    assert tuple(named.axis_names) == ("data", "model") and tuple(named.mesh_shape) == (2, 4)


def test_default_mesh_is_1d_over_all_devices():
    mesh = to_xs_mesh(None)
    assert tuple(mesh.axis_names) == ("model",) and tuple(mesh.mesh_shape) == (8,)


def test_cpu_device_mesh_rejected():
    class FakeMesh:
        pass
    with pytest.raises(xla_tp.MeshError, match="FakeMesh"):
        to_xs_mesh(FakeMesh())


def test_xs_mesh_axis_aliases_canonicalised():
    mesh = to_xs_mesh(xs.Mesh(np.arange(8), (2, 4), ("dp", "tp")))
    assert tuple(mesh.axis_names) == ("data", "model")
