"""``ShardLoadPlanner``: torch_xla's SPMD load planner without its read-back of the values it replaces.

torch_xla's ``SPMDLoadPlanner`` first copies every device's current shard of a tensor to the host
(``XLAShardedTensor.local_shards``), lets the storage reader overwrite those copies, and sends them
back: a host copy of each tensor per replica, filled with values about to be discarded. Here each
tensor's host shards start empty, one buffer per distinct block (``backends.host``), and freed
host memory is returned after each tensor. Example::

    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=ShardLoadPlanner(), no_dist=True)
"""
from __future__ import annotations

import math

import torch
import torch_xla
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem
from torch_xla.distributed.spmd.xla_sharded_tensor import XLAShard
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

from ..backends import host


class ShardLoadPlanner(SPMDLoadPlanner):
    """torch_xla's ``SPMDLoadPlanner`` for ``dcp.load``, without reading back the values it
    overwrites: each tensor's host shards start empty (replicas share one buffer), are filled by the
    storage reader, and go to the devices when the last one is complete."""


    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.unsharded_state_dict:
            return super().lookup_tensor(index)
        if index.fqn not in self._local_shards:
            t = self.sharded_state_dict[index.fqn].global_tensor
            blocks, shape = host.device_blocks(t)
            buffers = {host.block_key(b): host.host_buffer(b, shape, t.dtype) for b in host.distinct(blocks)}
            devices = torch_xla._XLAC._xla_get_runtime_devices()
            self._local_shards[index.fqn] = [XLAShard(buffers[host.block_key(b)], list(b), d, 0)
                                             for b, d in zip(blocks, devices)]
            self._pending_elements[index.fqn] = sum(math.prod(s.stop - s.start for s in b) for b in blocks)
        return self._local_shards[index.fqn][index.index].data

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        fqn = read_item.dest_index.fqn
        if fqn in self.sharded_state_dict and fqn not in self._local_shards:  # the tensor is complete
            host.release_host_memory()
