"""xla_tp.audit on programs whose optimum is known: exact counts and bytes, not timings."""
import pytest
import torch
import torch_xla
import transformers

import xla_tp
from bench.plans import hand_apply, to_torch_plan
from xla_tp.auditing import AuditReport
from xla_tp.auditing.run import audit
from xla_tp.plan.hf import hf_plan
from xla_tp.plan.normalize import build_layout
from xla_tp.zoo.llama import Llama, LlamaArgs, torchtitan_tp_plan

from ..helpers import MLP

PAIR = {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()}


def sharded_mlp(mesh):
    return xla_tp.parallelize_xla(MLP(16, 32, bias=False), PAIR, mesh=mesh)


def test_colwise_rowwise_mlp_is_optimal():
    mesh = xla_tp.make_mesh(data=2, model=4)
    x = torch.randn(8, 16).to(torch_xla.device())
    report = audit(sharded_mlp(mesh), x, mesh=mesh)
    assert report.collectives == {"all-reduce": {"count": 1, "bytes": 4 * 16 * 4, "axes": ["model"]}}
    assert report.expected == {"all-reduce": {"count": 1, "bytes": 4 * 16 * 4}}
    assert report.comm_ratio == 1.0
    assert report.compute_balance == 1.0
    assert report.param_memory_ratio == 1.0
    assert AuditReport.from_dict(report.to_dict()).to_dict() == report.to_dict()
    assert "all-reduce" in str(report)


def test_backward_adds_data_axis_gradient_reductions():
    mesh = xla_tp.make_mesh(data=2, model=4)
    x = torch.randn(8, 16).to(torch_xla.device())
    model = sharded_mlp(mesh)
    report = audit(model, x, mesh=mesh, backward=True)
    assert report.comm_ratio == 1.0 and report.compute_balance == 1.0
    assert set(report.collectives["all-reduce"]["axes"]) == {"model", "data"}
    assert all(p.grad is None for p in model.parameters())


class FeatureLayer(torch.nn.Module):
    """Two MLP blocks, returning the hidden state before the last (as Llava reads its vision tower's, Gemma 3 its
    tower's without the pooling head): the last block runs and nothing reads it."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([MLP(16, 32, bias=False), MLP(16, 32, bias=False)])

    def forward(self, x):
        states = [x]
        for block in self.blocks:
            states.append(block(states[-1]))
        return states[-2] * 2


@pytest.mark.parametrize("backward", [False, True])
def test_a_block_whose_output_nothing_reads_costs_nothing_in_the_minimum(backward):
    """The program drops the last block's work (its all-reduce, and with the backward its weights' gradients are
    zeros, reduced over no axis): the minimum counts the first block's only, so the program is at it, not below."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    plan = {f"blocks.{i}.{name}": style for i in (0, 1) for name, style in PAIR.items()}
    model = xla_tp.parallelize_xla(FeatureLayer(), plan, mesh=mesh)
    report = audit(model, torch.randn(8, 16).to(torch_xla.device()), mesh=mesh, backward=backward)
    assert report.comm_ratio == 1.0, (report.collectives, report.expected)
    assert report.expected["all-reduce"]["count"] == (1 + 2 if backward else 1)  # + the first block's 2 weight grads
    assert any("blocks.1.fc1" in note for note in report.notes), report.notes


def test_audit_leaves_rng_and_buffers_alone():
    mesh = xla_tp.make_mesh(model=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5))
    model = xla_tp.parallelize_xla(model, {"0": xla_tp.ColwiseParallel()}, mesh=mesh)
    seed = torch_xla.core.xla_model.get_rng_state()
    audit(model, torch.randn(8, 16).to(torch_xla.device()), mesh=mesh)
    assert torch_xla.core.xla_model.get_rng_state() == seed
    assert int(model[1].num_batches_tracked.cpu()) == 0


def titan(sequence_parallel: bool):
    mesh = xla_tp.make_mesh(data=2, model=4)
    torch.manual_seed(0)
    model = Llama(LlamaArgs())
    plan = torchtitan_tp_plan(model, sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, 128, (4, 16)).to(torch_xla.device())
    return audit(xla_tp.parallelize_xla(model, plan, mesh=mesh), tokens, mesh=mesh)


def test_regression_torchtitan_llama_megatron_plan():
    report = titan(sequence_parallel=False)
    assert report.comm_ratio == 1.0
    assert abs(report.compute_balance - 1.0) < 0.01
    assert report.count("all-gather") == 0
    assert report.count("all-reduce") == 1 + 2 * 2  # embedding + 2 per layer


def test_regression_torchtitan_llama_sequence_parallel_plan():
    report = titan(sequence_parallel=True)
    assert report.comm_ratio == 1.0
    assert abs(report.compute_balance - 1.0) < 0.01
    assert report.count("all-gather") == report.expected["all-gather"]["count"]  # activations only


def test_hand_applied_hf_llama_plan_shows_replicated_attention():
    mesh = xla_tp.make_mesh(data=2, model=4)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    plan = hf_plan(model)
    layout = build_layout(model, to_torch_plan(plan, model), {"data": 2, "model": 4}, "model")
    model = hand_apply(model.to(torch_xla.device()), plan, mesh)
    tokens = torch.randint(0, 128, (2, 16)).to(torch_xla.device())
    report = audit(model, tokens, mesh=mesh, plan_layout=layout)
    assert report.count("all-gather") > 0
    assert report.compute_balance > 1.1
    assert report.comm_ratio > 1.0
