"""Sharded checkpoints: bit-exact round trips that reshard across meshes, refusals that touch
nothing, keep-last-k, async saves, and a save killed half-way in a real subprocess."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.checkpoint import save as save_module
from xla_tp.checkpoint.store import CheckpointRoot
from xla_tp.state import record_of
from xla_tp.lowering.packed import packing_of, restore
from xla_tp.zoo.registry import build, example_input, run

from ..helpers import MLP, sharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP_PLAN = {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()}


def _trained(name, mesh, seed=0):
    """``name`` under "auto" on ``mesh`` with an AdamW that has taken one step."""
    torch.manual_seed(seed)
    model = build(name).train()
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(**mesh))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run(model, example_input(name).to(torch_xla.device())).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
    return model, opt


def _fresh(name, mesh, seed=1):
    torch.manual_seed(seed)
    model = build(name).train()
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(**mesh))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _values(model, opt):
    """Parameters and optimizer states on the CPU, re-laid packed weights (whose order depends on the
    model axis) back in their original order."""
    torch_xla.sync()

    def original(p, t):
        packing = packing_of(p)
        t = t.detach().cpu()
        return (restore(t, packing) if packing is not None and t.shape == p.shape else t).clone()

    params = {n: original(p, p) for n, p in model.named_parameters()}
    states = {(n, k): original(p, v) for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    return params, states


def _assert_sharded_as_planned(model, opt):
    """Every parameter has the sharding its plan gave it on this mesh; every state shaped like its
    parameter has the parameter's sharding."""
    for n, p in model.named_parameters():
        rec = record_of(p)
        if rec is not None:
            assert sharding(p) == rec.expected, n
        for k, v in opt.state[p].items():
            if v.shape == p.shape:
                assert (sharding(v) or "{replicated}") == (sharding(p) or "{replicated}"), (n, k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """GPT-2 (packed c_attn re-laid by "auto") trained one step on fsdp=2 x model=4, saved as step 1."""
    model, opt = _trained("gpt2", dict(fsdp=2, model=4))
    root = str(tmp_path_factory.mktemp("ckpt"))
    path = xla_tp.save_checkpoint(root, model, opt, step=1)
    return root, path, _values(model, opt), model


def test_round_trip_reshards_across_three_meshes(saved, tmp_path):
    root, path, (params, states), original = saved
    assert path == os.path.join(root, "step_00000001")
    assert packing_of(original.transformer.h[0].attn.c_attn.weight) is not None  # a re-laid layout was saved
    model, opt = _fresh("gpt2", dict(model=8))
    assert xla_tp.load_checkpoint(root, model, opt) == 1
    assert _equal(_values(model, opt), (params, states))
    _assert_sharded_as_planned(model, opt)
    xla_tp.save_checkpoint(str(tmp_path), model, opt, step=2)
    model, opt = _fresh("gpt2", dict(data=4, model=2))
    assert xla_tp.load_checkpoint(str(tmp_path), model, opt) == 2
    assert _equal(_values(model, opt), (params, states))
    _assert_sharded_as_planned(model, opt)


def _equal(a, b):
    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys() and sa.keys() == sb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    return True


def test_mismatching_checkpoint_is_refused_and_nothing_changes(saved):
    root, _, _, _ = saved
    model, opt = _fresh("llama", dict(fsdp=2, model=4))
    before = _values(model, opt)
    with pytest.raises(xla_tp.CheckpointError) as err:
        xla_tp.load_checkpoint(root, model, opt)
    msg = str(err.value)
    assert "missing from the checkpoint" in msg and "model.embed_tokens.weight" in msg
    assert "not in the model" in msg and "transformer.h.0.attn.c_attn.weight" in msg
    assert _equal(_values(model, opt), before)
    wide, wide_opt = _fresh("gpt2", dict(fsdp=2, model=4))
    wide.transformer.wte.weight.data = torch.zeros(256, 64, device=torch_xla.device())  # another vocab
    with pytest.raises(xla_tp.CheckpointError, match=r"transformer.wte.weight: checkpoint \(128, 64\) vs model \(256, 64\)"):
        xla_tp.load_checkpoint(root, wide, wide_opt)
    assert not wide_opt.state


def test_keep_last_k_and_next_step(tmp_path):
    model = MLP(16, 32)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=xla_tp.make_mesh(model=8))
    for step in range(4):
        xla_tp.save_checkpoint(str(tmp_path), model, step=step, keep=2)
    assert CheckpointRoot(str(tmp_path)).steps() == [2, 3]
    assert xla_tp.save_checkpoint(str(tmp_path), model).endswith("step_00000004")  # step=None: one past the newest
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003", "step_00000004"]


def test_async_save_returns_before_writing_and_keeps_the_snapshot(tmp_path, monkeypatch):
    model = MLP(16, 32)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=xla_tp.make_mesh(fsdp=2, model=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    release, writing = threading.Event(), threading.Event()
    real_save = save_module.dcp.save

    def slow_save(*args, **kwargs):
        writing.set()
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(save_module.dcp, "save", slow_save)
    handle = xla_tp.save_checkpoint(str(tmp_path), model, step=7, async_save=True)
    assert writing.wait(60) and not handle.done()  # returned while the write is still blocked
    model(torch.randn(8, 16, device=torch_xla.device())).sum().backward()
    opt.step()  # a training step runs during the save
    torch_xla.sync()
    assert not handle.done() and CheckpointRoot(str(tmp_path)).steps() == []
    release.set()
    assert handle.result(60) == os.path.join(str(tmp_path), "step_00000007")
    fresh = MLP(16, 32)
    xla_tp.parallelize_xla(fresh, MLP_PLAN, mesh=xla_tp.make_mesh(model=8))
    xla_tp.load_checkpoint(str(tmp_path), fresh)
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach().cpu(), snapshot[n]), n  # the state at save time, not after the step


KILLED_CHILD = r"""
import sys, time
import torch, xla_tp
from xla_tp.checkpoint import store
from xla_tp.zoo.registry import build

torch.manual_seed(0)
model = build("llama")
xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(fsdp=2, model=4))
xla_tp.save_checkpoint(sys.argv[1], model, step=1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)

def stalled_commit(self, tmp, *args, **kwargs):   # every file of step 2 is written: stop right here
    print("WRITTEN", tmp, flush=True)
    time.sleep(600)

store.CheckpointRoot.commit = stalled_commit
xla_tp.save_checkpoint(sys.argv[1], model, step=2)
"""


def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PJRT_DEVICE", "CPU_NUM_DEVICES") if k in os.environ}
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, root], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("WRITTEN"), line
        partial = line.split()[1]
        assert os.path.exists(os.path.join(partial, ".metadata"))  # a naive reader would take it as complete
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert CheckpointRoot(root).steps() == [1]
    torch.manual_seed(0)
    saved_values = build("llama").state_dict()  # what the child built (same seed) and saved as step 1
    model = build("llama")
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(model=8))
    assert xla_tp.load_checkpoint(root, model) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), saved_values[k]), k  # step 1's values, not step 2's (+1)
    with pytest.raises(xla_tp.CheckpointError, match="incomplete"):
        xla_tp.load_checkpoint(partial, model)
    xla_tp.save_checkpoint(root, model, step=3)  # the next save clears the dead save's directory
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000003"]
