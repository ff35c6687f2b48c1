"""The training step at Megatron's minimum: one input-gradient all-reduce per group of column-parallel
projections reading one activation (q/k/v, gate/up), vocabulary-parallel embeddings whose weight
gradient stays on each device's rows, and the audit's forward+backward minimum agreeing with it."""
import copy
import math

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch.distributed.device_mesh import DeviceMesh

import xla_tp
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.auditing.hlo import parse_collectives
from xla_tp.auditing.run import unsharded_dot_flops
from xla_tp.backends.annotate import XlaSharder
from xla_tp.lowering.embedding import install_embedding
from xla_tp.lowering.groups import install_group
from xla_tp.lowering.tied import install_tie
from xla_tp.zoo import registry
from xla_tp.zoo.cuda_llama import CudaLlama, sp_plan_calls
from xla_tp.zoo.llama import LlamaArgs

from ..helpers import lowered_forward, max_err

LAYERS = registry.LAYERS
# Megatron, forward: the vocabulary-parallel embedding and two row-parallel outputs per layer; backward:
# one per column group (attention's input projections, the MLP's first) per layer and the LM head's input
MEGATRON = (1 + 2 * LAYERS) + (2 * LAYERS + 1)


def _collectives(tensors):
    return parse_collectives(capture_partitioned_hlo(list(tensors)))


def _audit(name: str, data: int, reference_first: bool = False):
    mesh = xla_tp.make_mesh(data=data, model=8 // data)
    torch.manual_seed(0)
    model = registry.build(name)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    x = registry.example_input(name).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("data", None))
    args = registry.positional_args(model, x)
    if reference_first:  # the unsharded reference (swapped-in tensors) is the model's first forward
        unsharded_dot_flops(model, args, True)
    return xla_tp.audit(model, *args, mesh=mesh, backward=True)


@pytest.mark.parametrize("name", ["llama", "titan_llama", "gpt2", "bert"])
def test_training_step_has_megatrons_all_reduces(name):
    """1x8: every all-reduce is an activation's; the compiled forward+backward has Megatron's number and
    the audit's minimum says the same."""
    report = _audit(name, data=1)
    assert report.count("all-reduce") == MEGATRON and report.count("all-gather") == 0, report
    assert report.expected["all-reduce"]["count"] == MEGATRON, report.expected
    assert report.comm_ratio == pytest.approx(1.0), report


def test_qwen3_training_step_adds_only_its_head_norm_gradients():
    """Qwen3 normalises q and k per head (replicated weights on head-split activations): their weight
    gradients are the only all-reduces beyond Megatron's."""
    report = _audit("qwen3", data=1)
    assert report.count("all-reduce") == MEGATRON + 2 * LAYERS and report.count("all-gather") == 0, report
    assert report.comm_ratio == pytest.approx(1.0, abs=0.002), report


@pytest.mark.parametrize("name", ["llama", "titan_llama"])
def test_training_step_on_a_2x4_mesh_is_at_the_audits_minimum(name):
    """With a data axis every parameter gradient is reduced once over it, at its local size."""
    assert _audit(name, data=2).comm_ratio == pytest.approx(1.0)


def test_an_unsharded_reference_run_first_leaves_the_lowering_to_the_next_call():
    """The first forward finds the lowering (column groups, vocabulary-split tables). A first call on
    swapped-in unsharded tensors cannot see the tables' marks: it must not use up that step (it did,
    and the bench read the embedding's gradient reduced over the whole mesh)."""
    report = _audit("llama", data=2, reference_first=True)
    assert report.comm_ratio == pytest.approx(1.0), report


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_tied_embeddings_on_a_2x4_mesh_reduce_their_gradient_once(name):
    """GPT-2 and BERT read one table in the embedding and the LM head: one all-reduce of its gradient
    over the data axis, as for any parameter. The bytes are below the minimum, which counts every
    table whole: XLA reduces only the position rows a 16-token sequence touches."""
    report = _audit(name, data=2)
    assert report.count("all-reduce") == report.expected["all-reduce"]["count"], report
    assert report.count("all-gather") == 0, report
    assert 0.85 < report.comm_ratio <= 1.0, report


def test_cuda_style_llama_under_the_sp_plan_trains_at_the_sp_minimum():
    xla_tp.make_mesh(model=8)
    model = CudaLlama(LlamaArgs(dim=64, n_heads=8, n_layers=LAYERS))
    for module, plan in sp_plan_calls(model):
        xla_tp.parallelize_module(module, DeviceMesh("xla", list(range(8))), plan)
    tokens = torch.randint(0, 128, (4, 16)).to(torch_xla.device())
    report = xla_tp.audit(model, tokens, mesh=xla_tp.make_mesh(model=8), backward=True)
    assert report.comm_ratio == pytest.approx(1.0, abs=0.01), report


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


class _SquaredSum(torch.nn.Module):
    def __init__(self, layers: torch.nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return sum((lin(x) ** 2).sum() for lin in self.layers)


def test_a_column_group_reduces_its_input_gradient_once(mesh):
    """q, k and v of different widths (GQA) reading one x: one all-reduce of x's gradient, not three;
    values and gradients as on the CPU."""
    torch.manual_seed(0)
    ref = torch.nn.ModuleList([torch.nn.Linear(64, n, bias=b) for n, b in ((64, True), (32, False), (32, True))])
    x_ref = torch.randn(8, 16, 64, requires_grad=True)
    results = {}
    for grouped in (False, True):
        layers = copy.deepcopy(ref).to(torch_xla.device())
        for lin in layers:
            xs.mark_sharding(lin.weight, mesh, ("model", None))
            if lin.bias is not None:
                xs.mark_sharding(lin.bias, mesh, ("model",))
        model = _SquaredSum(layers)
        if grouped:
            lowered_forward(model, mesh, tp=4)  # the group acts inside a parallelized forward
            install_group(list(layers), tp=4)
        x = x_ref.detach().to(torch_xla.device()).requires_grad_()
        xs.mark_sharding(x, mesh, ("data", None, None))
        loss = model(x)
        got = torch.autograd.grad(loss, [x, *layers.parameters()])
        results[grouped] = [c for c in _collectives(got[:1]) if c.kind == "all-reduce"]
        if grouped:
            ref_loss = sum((lin(x_ref) ** 2).sum() for lin in ref)
            want = torch.autograd.grad(ref_loss, [x_ref, *ref.parameters()])
            for g, w in zip(got, want):
                assert max_err(g, w) < 1e-3
    assert len(results[False]) == 3 and len(results[True]) == 1, results


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_a_vocabulary_parallel_embedding_reduces_one_devices_rows_over_the_data_axis(mesh, padding_idx):
    torch.manual_seed(0)
    ref = torch.nn.Embedding(128, 64, padding_idx=padding_idx)
    ids = torch.randint(0, 128, (4, 16))
    ids[0, :3] = 5
    dy = torch.randn(4, 16, 64)
    emb = copy.deepcopy(ref).to(torch_xla.device())
    xs.mark_sharding(emb.weight, mesh, ("model", None))
    lowered_forward(emb, mesh, tp=4)  # a parallelized forward: F.embedding is lowered in it
    install_embedding(emb, tp=4, sharder=XlaSharder(mesh), spec=("model", None))
    xids, xdy = ids.to(torch_xla.device()), dy.to(torch_xla.device())
    xs.mark_sharding(xids, mesh, ("data", None))
    xs.mark_sharding(xdy, mesh, ("data", None, None))
    (grad,) = torch.autograd.grad(emb(xids), [emb.weight], xdy)
    found = _collectives([grad])
    assert [(c.kind, math.prod(c.shape)) for c in found] == [("all-reduce", 32 * 64)], found  # one device's rows
    (want,) = torch.autograd.grad(ref(ids), [ref.weight], dy)
    assert max_err(grad, want) < 1e-4


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(128, 64), torch.nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("tied", [False, True])
def test_a_tied_table_reads_one_stack_and_reduces_its_gradient_once(mesh, tied):
    """An embedding and an LM head reading one vocabulary-split weight: with a ``Tie``, the weight's
    gradient is one all-reduce over the data axis of one device's rows (two without); values as on
    the CPU either way."""
    torch.manual_seed(0)
    ref = TiedLM()
    ids, target = torch.randint(0, 128, (4, 16)), torch.randn(4, 16, 128)
    model = copy.deepcopy(ref).to(torch_xla.device())
    model.head.weight = model.emb.weight  # moving a module to the XLA device unties it
    xs.mark_sharding(model.emb.weight, mesh, ("model", None))
    lowered_forward(model, mesh, tp=4)  # its forward is a parallelized one
    install_embedding(model.emb, tp=4, sharder=XlaSharder(mesh), spec=("model", None))
    if tied:
        install_tie(model.emb, axes="data", replicas=2)
    xids, xtarget = ids.to(torch_xla.device()), target.to(torch_xla.device())
    xs.mark_sharding(xids, mesh, ("data", None))
    xs.mark_sharding(xtarget, mesh, ("data", None, "model"))
    (grad,) = torch.autograd.grad((model(xids) * xtarget).sum(), [model.emb.weight])
    laid_out = XlaSharder(mesh).annotate(grad, ("model", None))  # as a parameter's gradient is
    over_data = [(c.kind, math.prod(c.shape)) for c in _collectives([laid_out]) if len(c.replica_groups[0]) == 2]
    assert over_data == [("all-reduce", 32 * 64)] * (1 if tied else 2), over_data
    (want,) = torch.autograd.grad((ref(ids) * target).sum(), [ref.emb.weight])
    assert max_err(grad, want) < 1e-3
