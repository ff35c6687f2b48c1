"""Per-host data: which rows of the global batch each host reads, and reading only those rows.

``device_rows`` is checked against the batch split the mesh gives (the row blocks over the batch axes);
``host_rows`` for every host of a few meshes: the hosts together cover the batch, each row read by as many
hosts as there are hosts per batch block; ``Batches.get(step, rows)`` equals those rows of the whole batch.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from xla_tp import processes
from xla_tp.launch.data import Batches, device_rows, host_rows
from xla_tp.launch.recipe import DataSpec

MESHES = [{"data": 8}, {"data": 2, "fsdp": 2, "model": 2}, {"data": 4, "model": 2}, {"fsdp": 2, "model": 4},
          {"model": 8}, {"data": 2, "context": 2, "model": 2}]


@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_each_device_holds_its_block_of_the_batch(axes):
    batch = 16
    names = [a for a in ("data", "fsdp", "context", "model") if a in axes or a in ("data", "fsdp", "model")]
    grid = np.arange(8).reshape([axes.get(a, 1) for a in names])
    rows = device_rows(batch, axes)
    split = [a for a in ("data", "fsdp") if axes.get(a, 1) > 1]
    ways = int(np.prod([axes[a] for a in split])) if split else 1
    for device in range(8):
        coords = dict(zip(names, (int(c[0]) for c in np.nonzero(grid == device))))
        block = int(np.ravel_multi_index([coords[a] for a in split], [axes[a] for a in split])) if split else 0
        assert list(rows[device]) == list(range(block * batch // ways, (block + 1) * batch // ways))


@pytest.mark.parametrize("hosts", [1, 2, 4, 8])
@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_hosts_together_read_the_batch(axes, hosts):
    batch, per = 16, 8 // hosts
    seen: collections.Counter = collections.Counter()
    held = device_rows(batch, axes)
    for h in range(hosts):
        devices = list(range(h * per, (h + 1) * per))[::-1]   # any runtime order
        mine = host_rows(batch, axes, devices)
        assert mine.rows == sorted(set(mine.rows)) and mine.batch == batch
        for device, block in zip(devices, mine.shards):
            assert [mine.rows[i] for i in range(block.start, block.stop)] == list(held[device])
        seen.update(mine.rows)
    assert sorted(seen) == list(range(batch))
    assert len(set(seen.values())) == 1          # every row read by the same number of hosts
    if hosts <= len({tuple(r) for r in held}):   # as many batch blocks as hosts, or more: each row once
        assert set(seen.values()) == {1}


@pytest.mark.parametrize("kind,task", [("text", "causal-lm"), ("text", "masked-lm"), ("synthetic", "causal-lm"),
                                       ("synthetic", "masked-lm")])
def test_a_host_reads_exactly_its_rows_of_the_batch(kind, task):
    spec = DataSpec(kind, "data/tiny_corpus.txt" if kind == "text" else None)
    batches = Batches(spec, vocab=300, batch=8, seq_len=32, seed=3, task=task)
    for step in (0, 5):
        whole = batches.get(step)
        for rows in ([0, 1, 2, 3], [4, 5, 6, 7], [2, 6]):
            part = batches.get(step, rows)
            assert all(torch.equal(p, w[rows]) for p, w in zip(part, whole))
    assert batches.get(1, list(range(8)))[0].equal(batches.get(1)[0])


def test_one_process_is_the_reporter_and_needs_no_group():
    assert (processes.index(), processes.count(), processes.is_reporter()) == (0, 1, True)
    assert processes.init_group() is False            # nothing to join on one host
    assert processes.from_reporter("x") == "x" and processes.gathered(3) == [3]
    processes.barrier()
