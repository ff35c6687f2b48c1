"""``xla_tp.init_device_mesh``: torch's signature, torch's slicing, on an XLA SPMD mesh."""
import pytest
import torch_xla.distributed.spmd as xs
from torch.distributed.device_mesh import DeviceMesh

import xla_tp
from xla_tp import ColwiseParallel, MeshError, PlanError
from xla_tp.mesh import to_xs_mesh
from xla_tp import layout_of

from ..helpers import MLP, expected_sharding, sharding
from ..fresh import run_fresh


def test_slices_are_torch_device_meshes_that_remember_the_whole_mesh():
    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
    tp, dp = world["tp"], world["dp"]
    assert isinstance(tp, DeviceMesh) and tp.device_type == "xla"
    assert tp.mesh.tolist() == [0, 1, 2, 3] and tp.size() == 4 and tp.mesh_dim_names == ("tp",)
    assert dp.mesh.tolist() == [0, 4] and dp.size() == 2
    assert world["dp", "tp"] is world
    assert world["tp", "dp"].mesh.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for mesh in (world, tp, dp, world["tp", "dp"]):
        whole = to_xs_mesh(mesh)
        assert tuple(whole.axis_names) == ("data", "model") and tuple(whole.mesh_shape) == (2, 4)
    assert tuple(xs.get_global_mesh().axis_names) == ("data", "model")


def test_tp_slice_shards_over_tp_and_keeps_the_batch_over_dp():
    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
    model = xla_tp.parallelize_module(MLP(16, 32), world["tp"], {"fc1": ColwiseParallel()})
    assert sharding(model.fc1.weight) == expected_sharding((32, 16), to_xs_mesh(world), ("model", None))
    layout = layout_of(model)
    assert (layout.tp_axis, layout.batch_axes) == ("model", ("data",))


@pytest.mark.parametrize("call, words", [
    (lambda: xla_tp.init_device_mesh("cuda", (8,)), ["'cuda'", "'xla'"]),
    (lambda: xla_tp.init_device_mesh("xla", (3, 3), mesh_dim_names=("dp", "tp")), ["9", "8"]),
    (lambda: xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("tp",)), ["mesh_dim_names", "2-D"]),
    (lambda: xla_tp.init_device_mesh("xla", (2, 4)), ["needs axis names"]),
    (lambda: xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))["pp"], ["'pp'", "('dp', 'tp')"]),
    (lambda: xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))["tp"].get_coordinate(),
     ["one process", "global batch"]),
])
def test_bad_meshes_and_rank_queries_raise_mesh_error(call, words):
    with pytest.raises(MeshError) as error:
        call()
    assert all(w in str(error.value) for w in words), str(error.value)


def test_batch_slice_is_not_a_tensor_parallel_axis():
    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
    model = MLP(16, 32)
    with pytest.raises(PlanError, match="'data' carries the batch.*world\\['tp'\\]"):
        xla_tp.parallelize_module(model, world["dp"], {"fc1": ColwiseParallel()})
    assert model.fc1.weight.device.type == "cpu"


TORCHTITAN = '''
import copy
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)
from xla_tp import init_device_mesh, parallelize_module   # torchtitan imports these from torch
import torch_xla
import xla_tp
from xla_tp.zoo.llama import Llama, LlamaArgs


def apply_tp(model, tp_mesh):
    """torchtitan's apply_tp (llama3/infra/parallelize.py), loss parallel and sequence parallel on."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for transformer_block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=layer_plan)


world_mesh = init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = Llama(LlamaArgs())
reference = copy.deepcopy(model)
tokens = torch.randint(0, 128, (4, 16))
labels = torch.randint(0, 128, (4, 16))

ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
ref_loss.backward()

apply_tp(model, world_mesh["tp"])
device = torch_xla.device()
loss = F.cross_entropy(model(tokens.to(device)).flatten(0, 1), labels.to(device).flatten())
loss.backward()
torch_xla.sync()
grads = dict(model.named_parameters())
err = max((grads[n].grad.cpu() - p.grad).abs().max().item() for n, p in reference.named_parameters())
print("loss", ref_loss.item(), loss.item(), "grad_err", err)
report = xla_tp.audit(model, tokens.to(device), mesh=world_mesh, backward=True)
print("audit", report.compute_balance, sorted({a for c in report.collectives.values() for a in c["axes"]}))
print("wq", torch_xla._XLAC._get_xla_sharding_spec(model.layers["0"].attention.wq.weight))
'''


@pytest.mark.complete
def test_torchtitan_code_on_the_tp_slice_matches_cpu():
    out = run_fresh(TORCHTITAN)
    loss_line = next(line.split() for line in out.splitlines() if line.startswith("loss "))
    ref_loss, loss, grad_err = float(loss_line[1]), float(loss_line[2]), float(loss_line[4])
    assert abs(loss - ref_loss) < 1e-5 and grad_err < 1e-5, loss_line
    audit_line = next(line for line in out.splitlines() if line.startswith("audit "))
    balance = float(audit_line.split()[1])
    assert abs(balance - 1.0) < 0.01, audit_line  # every device does 1/8 of the work: tp x dp
    assert "'data'" in audit_line and "'model'" in audit_line  # gradients reduced over dp, activations over tp
    assert "devices=[4,1,2]" in out  # wq: 4-way over tp, replicated over dp
