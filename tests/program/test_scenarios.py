"""The seed scenarios: inference mode, custom ops, bitcasting optimizers, meta/CPU materialisation."""
import logging

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.zoo.llama import Llama, LlamaArgs, precompute_rope, torchtitan_tp_plan

from ..helpers import MLP, Tied, expected_sharding, grads, max_err, sharding, twin

MLP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def test_upstream_inference_mode_bug_is_real():
    """torch_xla 2.9 fails under inference_mode with no sharding at all (why xla_tp works around it)."""
    lin = nn.Linear(8, 8).to(torch_xla.device())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="version_counter"):
        lin(torch.randn(2, 8, device=torch_xla.device()))


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_tp_inference_modes(mode):
    args = LlamaArgs(dim=64, n_layers=1, n_heads=8, vocab_size=128)
    ref, model = twin(Llama, args)
    xla_tp.parallelize_xla(model, torchtitan_tp_plan(model), mesh=xla_tp.make_mesh(data=2, model=4))
    tokens = torch.randint(0, 128, (2, 8))
    with mode():
        logits = model(tokens.to(model.output.weight.device))
        last = logits[:, -1]  # the caller's own views of the output work too
        assert logits.requires_grad is False
        assert max_err(last, ref(tokens)[:, -1]) < 1e-5
    if mode is torch.inference_mode:
        assert logits.is_inference()


@torch.library.custom_op("xla_tp_test::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    scaled_gelu.seen.append((type(x), sharding(x) if x.device.type == "xla" else None))
    return F.gelu(x) * scale


scaled_gelu.seen = []


@scaled_gelu.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup_ctx(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        xx = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(F.gelu(xx) * ctx.scale, xx, grad)
    return g, None


scaled_gelu.register_autograd(_backward, setup_context=_setup_ctx)


class CustomOpMLP(MLP):
    def forward(self, x):
        return self.fc2(scaled_gelu(self.fc1(x), 0.5))


def test_custom_op_receives_sharded_plain_tensors():
    ref, model = twin(CustomOpMLP, 16, 64)
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=mesh)
    x = torch.randn(8, 16)
    scaled_gelu.seen.clear()
    out = model(x.to(model.fc1.weight.device))
    kind, spec = scaled_gelu.seen[-1]
    assert kind is torch.Tensor  # no DTensor / XLAShardedTensor reaches the op
    assert spec == expected_sharding((8, 64), mesh, ("data", "model"))
    out.sum().backward()
    ref(x).sum().backward()
    assert max_err(out, ref(x)) < 1e-5
    g, g_ref = grads(model), grads(ref)
    assert all(max_err(g[n], g_ref[n]) < 1e-5 for n in g_ref)


class StochasticRoundingSGD(torch.optim.Optimizer):
    """SGD whose fp32 update is rounded stochastically to bf16 precision through int32 bitcasts
    (torchao's fp32 -> bf16 stochastic rounding) and written back with ``copy_``."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                upd = p.float() - group["lr"] * p.grad.float()
                bits = upd.view(torch.int32)
                noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
                low, high = bits & 0xFFFF, bits & -65536
                p.copy_(torch.where(noise < low, high + 0x10000, high).view(torch.float32))


def test_bitcast_optimizer_keeps_shardings(caplog):
    mesh = xla_tp.make_mesh(model=8)
    model = MLP(16, 64)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=mesh)
    before = {n: (sharding(p), p.detach().cpu().clone()) for n, p in model.named_parameters()}
    opt = StochasticRoundingSGD(model.parameters())
    model(torch.randn(8, 16, device=model.fc1.weight.device)).sum().backward()
    with caplog.at_level(logging.INFO, logger="xla_tp.guard"):
        opt.step()
    assert "dropped the sharding" in caplog.text  # the bitcast update did drop it: the guard restored it
    torch_xla.sync()
    for n, p in model.named_parameters():
        assert sharding(p) == before[n][0], n
        assert not torch.equal(p.detach().cpu(), before[n][1]), f"{n} was not updated"


def test_without_the_guard_a_bitcast_update_replicates():
    """The failure xla_tp prevents, shown on a parameter it does not manage."""
    import torch_xla.distributed.spmd as xs
    mesh = xla_tp.make_mesh(model=8)
    p = nn.Parameter(torch.randn(64, 16).to(torch_xla.device()))
    xs.mark_sharding(p, mesh, ("model", None))
    p.grad = torch.ones_like(p)
    StochasticRoundingSGD([p]).step()
    assert sharding(p) == "{replicated}"


def test_meta_model_is_materialised_sharded():
    mesh = xla_tp.make_mesh(data=2, model=4)
    args = LlamaArgs(dim=64, n_layers=1, n_heads=8, vocab_size=128)
    with torch.device("meta"):
        model = Llama(args)
    xla_tp.parallelize_xla(model, torchtitan_tp_plan(model), mesh=mesh)
    for n, p in model.named_parameters():
        assert p.device.type == "xla" and not p.is_meta, n
    assert sharding(model.layers["0"].attention.wq.weight) == expected_sharding((64, 64), mesh, ("model", None))
    assert sharding(model.output.weight) == expected_sharding((128, 64), mesh, ("model", None))
    assert torch.equal(model.norm.weight.cpu(), torch.ones(64))
    assert max_err(model.rope, precompute_rope(8, args.max_seq_len, args.rope_theta)) < 1e-6
    assert 0.01 < model.layers["0"].attention.wq.weight.cpu().std().item() < 1.0  # initialised, not empty
    assert torch.isfinite(model(torch.randint(0, 128, (2, 8), device=model.output.weight.device)).cpu()).all()


def test_cpu_model_moves_with_ties_kept():
    ref, model = twin(Tied)
    mesh = xla_tp.make_mesh(model=8)
    xla_tp.parallelize_xla(model, {"emb": RowwiseParallel(), "head": ColwiseParallel()}, mesh=mesh)
    assert model.head.weight is model.emb.weight
    assert sharding(model.emb.weight) == expected_sharding((64, 16), mesh, ("model", None))
    ids = torch.randint(0, 64, (2, 8))
    assert max_err(model(ids.to(torch_xla.device())), ref(ids)) < 1e-5


def test_model_already_on_xla_is_sharded_in_place():
    model = MLP(16, 64).to(torch_xla.device())
    weight = model.fc1.weight
    mesh = xla_tp.make_mesh(model=8)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=mesh)
    assert model.fc1.weight is weight
    assert sharding(weight) == expected_sharding((64, 16), mesh, ("model", None))


def test_distribute_tensor_backend_numerics():
    ref, model = twin(MLP, 16, 64)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=xla_tp.make_mesh(data=2, model=4), backend="distribute_tensor")
    x = torch.randn(8, 16)
    out = model(x.to(model.fc1.weight.device))
    out.sum().backward()
    ref(x).sum().backward()
    assert max_err(out, ref(x)) < 1e-5
    g, g_ref = grads(model), grads(ref)
    assert all(max_err(g[n], g_ref[n]) < 1e-5 for n in g_ref)
