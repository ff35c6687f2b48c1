"""Multi-slice meshes, dry-run: the ``HybridMesh`` the launcher builds for ``v5e-256x2`` and ``v5p-64x2``.

torch_xla's ``HybridMesh`` reads each device's coordinates and slice index from the TPU runtime and refuses
anything else; here the runtime's device list is replaced by the slices' devices (as a TPU VM reports them:
``coords``, ``slice_index``), so torch_xla's own code lays out the mesh without a TPU. What is checked: the
shapes ``hybrid_shapes`` derives from the topology, and that in the mesh torch_xla builds from them, the data
axis alone crosses slices (every fsdp x model block lies in one slice), which is what keeps DCN traffic to the
data axis; and the rows each device reads follow the mesh's device order.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla.distributed.spmd import xla_sharding

from xla_tp.launch import load_topology
from xla_tp.launch.data import device_rows
from xla_tp.launch.schema import LaunchError
from xla_tp.launch.slices import hybrid_mesh, hybrid_shapes


def _devices(topology) -> list[dict]:
    """Device attributes of ``topology``'s slices as the TPU runtime lists them: one per chip."""
    dims = ([int(d) for d in topology.physical_topology.split("x")] + [1])[:3]
    cells = list(itertools.product(*[range(d) for d in dims]))
    per = len(cells)
    return [{"name": f"TPU:{s * per + i}", "coords": list(c), "slice_index": s, "core_on_chip": 0}
            for s in range(topology.slices) for i, c in enumerate(cells)]


@pytest.fixture
def on_slices(monkeypatch):
    def use(topology):
        devices = _devices(topology)
        monkeypatch.setattr(xr, "global_runtime_device_attributes", lambda: [dict(d) for d in devices])
        monkeypatch.setattr(xr, "global_runtime_device_count", lambda: len(devices))
        monkeypatch.setattr(xm, "xla_device_hw", lambda device: "TPU")
        monkeypatch.setattr(xla_sharding, "set_global_mesh", lambda mesh: None)
        return devices
    return use


@pytest.mark.parametrize("name", ["v5e-256x2", "v5p-64x2"])
def test_the_data_axis_alone_crosses_the_slices(name, on_slices):
    topology = load_topology(name)
    devices = on_slices(topology)
    names, ici, dcn = hybrid_shapes(topology.mesh, topology.slices)
    assert names == ("data", "fsdp", "model") and dcn == (2, 1, 1)
    assert tuple(i * d for i, d in zip(ici, dcn)) == tuple(topology.mesh.get(a, 1) for a in names)
    mesh = hybrid_mesh(topology.mesh, topology.slices)
    grid = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    assert sorted(grid.ravel().tolist()) == list(range(topology.chips))
    slice_of = np.vectorize(lambda d: devices[d]["slice_index"])(grid)
    for replica in range(topology.mesh["data"]):
        assert len(set(slice_of[replica].ravel().tolist())) == 1        # one data replica = one slice
    assert len(set(slice_of[:, 0, 0].tolist())) == topology.slices      # the data axis spans them
    batch, model = 2 * topology.chips, topology.mesh["model"]
    rows = device_rows(batch, topology.mesh, grid.ravel().tolist())
    per = batch * model // topology.chips
    for position, device in enumerate(grid.ravel().tolist()):           # rows follow the mesh's order
        block = position // model
        assert rows[device] == range(block * per, (block + 1) * per)


def test_a_mesh_whose_data_axis_does_not_cover_the_slices_is_refused():
    with pytest.raises(LaunchError, match=r"data=1 must be a multiple of the 2 slices"):
        hybrid_shapes({"fsdp": 128, "model": 4}, 2)
