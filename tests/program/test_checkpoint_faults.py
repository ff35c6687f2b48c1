"""Damaged checkpoints and full disks: a load is all or nothing, a failed save leaves nothing.

Each load test damages a saved checkpoint the way a disk, a copy or a person does, loads it into a
model and optimizer that have moved on since, and asserts ``CheckpointError`` naming the file, with
every parameter and optimizer state bit-identical to before.
"""
import errno
import json
import os

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.checkpoint import integrity
from xla_tp.checkpoint import load as load_module
from xla_tp.checkpoint.store import MARKER, CheckpointRoot

from ..helpers import MLP

PLAN = {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()}
SHARD = "__0_0.distcp"


def _train_step(model, opt):
    model(torch.randn(8, 16, device=torch_xla.device())).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()


def _model_and_optimizer():
    torch.manual_seed(0)
    model = MLP(16, 32)
    xla_tp.parallelize_xla(model, PLAN, mesh=xla_tp.make_mesh(fsdp=2, model=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return model, opt


def _state(model, opt):
    torch_xla.sync()
    return ({n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            {(n, k): v.detach().cpu().clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()})


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.fixture
def moved_on(tmp_path):
    """A checkpoint of step 1 under ``tmp_path``, and the model and optimizer one step further."""
    model, opt = _model_and_optimizer()
    step_dir = xla_tp.save_checkpoint(str(tmp_path), model, opt, step=1)
    _train_step(model, opt)
    return str(tmp_path), step_dir, model, opt


def _refused(path, model, opt, match=None) -> str:
    """The message of the ``CheckpointError`` loading ``path`` raises; the model and optimizer unchanged."""
    before = _state(model, opt)
    with pytest.raises(xla_tp.CheckpointError, match=match) as error:
        xla_tp.load_checkpoint(path, model, opt)
    _assert_same(_state(model, opt), before)
    assert isinstance(error.value, Exception)
    return str(error.value)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "truncated shard": (SHARD, _truncate, "truncated"),
    "deleted shard": (SHARD, os.remove, "is missing"),
    "byte-flipped shard": (SHARD, _flip, "does not match the SHA-256"),
    "missing .metadata": (".metadata", os.remove, "is missing"),
    "missing marker": (MARKER, os.remove, "incomplete checkpoint"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file_and_nothing_changes(moved_on, damage):
    root, step_dir, model, opt = moved_on
    name, do, words = DAMAGE[damage]
    assert os.path.isfile(os.path.join(step_dir, name))
    do(os.path.join(step_dir, name))
    message = _refused(step_dir, model, opt)
    assert name in message and words in message, message


def test_the_marker_records_every_file_and_a_root_names_the_older_checkpoints(moved_on):
    root, step_dir, model, opt = moved_on
    files = json.load(open(os.path.join(step_dir, MARKER)))["files"]
    assert sorted(files) == sorted(n for n in os.listdir(step_dir) if n != MARKER)
    for name, record in files.items():
        assert record["size"] == os.path.getsize(os.path.join(step_dir, name))
        assert record["sha256"] == integrity._sha256(os.path.join(step_dir, name))
    newer = xla_tp.save_checkpoint(root, model, opt, step=2)
    _flip(os.path.join(newer, SHARD))
    _refused(root, model, opt, match=r"(?s)step_00000002.*SHA-256.*Older checkpoints.*steps 1")


def test_a_checkpoint_without_recorded_checksums_loads_after_a_size_check(moved_on):
    root, step_dir, model, opt = moved_on
    saved = _state(*_reloaded(step_dir))
    marker = os.path.join(step_dir, MARKER)
    info = json.load(open(marker))
    del info["files"]                      # as the first format wrote it
    info["format"] = 1
    json.dump(info, open(marker, "w"))
    assert xla_tp.load_checkpoint(step_dir, model, opt) == 1
    _assert_same(_state(model, opt), saved)
    _train_step(model, opt)
    _truncate(os.path.join(step_dir, SHARD))
    _refused(step_dir, model, opt, match=rf"{SHARD} is [\d,]+ bytes but its tensors reach byte [\d,]+ \(truncated\)")


def _reloaded(step_dir):
    model, opt = _model_and_optimizer()
    xla_tp.load_checkpoint(step_dir, model, opt)
    return model, opt


def test_a_read_that_fails_half_way_changes_nothing(moved_on, monkeypatch):
    """The shard is damaged after the check (the check is skipped here): DCP fails part-way through
    reading, with a BaseException, and the model and optimizer still hold their own values."""
    root, step_dir, model, opt = moved_on
    monkeypatch.setattr(load_module, "verify", lambda d: load_module.dcp.FileSystemReader(d).read_metadata())
    _truncate(os.path.join(step_dir, SHARD))
    _refused(step_dir, model, opt, match="reading checkpoint .* failed .*unchanged")


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    room = 1000

    def __init__(self, path):
        self.file, self.path = open(path, "wb"), path

    def write(self, data):
        n = memoryview(data).nbytes
        if _FullDisk.room < n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        _FullDisk.room -= n
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_says_so_and_leaves_nothing(moved_on, monkeypatch, async_save):
    root, step_dir, model, opt = moved_on
    monkeypatch.setattr(integrity, "open_for_write", _FullDisk)
    monkeypatch.setattr(_FullDisk, "room", 1000)
    with pytest.raises(xla_tp.CheckpointError) as error:
        result = xla_tp.save_checkpoint(root, model, opt, step=2, async_save=async_save)
        if async_save:
            result.result(60)
    message = str(error.value)
    assert "disk full (ENOSPC)" in message and SHARD in message and "intact" in message, message
    assert sorted(os.listdir(root)) == ["step_00000001"]          # no half checkpoint, hidden or not
    assert CheckpointRoot(root).steps() == [1]
    monkeypatch.undo()
    saved = _state(*_reloaded(step_dir))                        # the older checkpoint still loads
    assert xla_tp.load_checkpoint(root, model, opt) == 1
    _assert_same(_state(model, opt), saved)
