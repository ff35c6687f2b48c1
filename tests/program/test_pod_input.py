"""The pod's input path on one process: the global batch assembled from per-device blocks
(``to_device(rows, mesh, host)``, torch_xla's sharded-input path) is today's batch: the same values and the
same sharding as ``to_device(batch, mesh)``, on every mesh, and the same results of a computation on it.
"""
from __future__ import annotations

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.launch.data import host_rows
from xla_tp.launch.train import to_device


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "fsdp": 2, "model": 2}, {"fsdp": 2, "model": 4},
                                  {"model": 8}], ids=str)
def test_the_batch_assembled_from_blocks_is_the_batch(axes):
    mesh = xla_tp.make_mesh(**axes)
    batch = torch.arange(16 * 6).view(16, 6)
    host = host_rows(16, axes, range(8))
    assembled, today = to_device(batch[host.rows], mesh, host), to_device(batch, mesh)
    spec = torch_xla._XLAC._get_xla_sharding_spec
    assert spec(assembled) == spec(today) != ""
    assert torch.equal(assembled.cpu(), batch)
    assert torch.equal((assembled * 3 + 1).sum(dim=1).cpu(), (today * 3 + 1).sum(dim=1).cpu())
