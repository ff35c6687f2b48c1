"""The JAX backend against torch CPU and against the torch_xla backend, same models and plans.

Two independent lowerings of one ``Layout`` (``mark_sharding`` + GSPMD, ``NamedSharding`` + Shardy):
a disagreement in a parameter's placement or in an output is a bug in one of them.
"""
import copy

import pytest
import torch

import xla_tp
from xla_tp.lowering.packed import packing_of, restore
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.auditing.hlo import parse_collectives
from xla_tp.backends.jax.runtime import to_torch
from xla_tp.zoo import registry
from xla_tp.zoo.llama import Llama, LlamaArgs, torchtitan_tp_plan

from ..helpers import MLP, max_err
from ..helpers_jax import both_backends, jax_blocks, xla_blocks

AXES = {"data": 2, "model": 4}


def _hf(name):
    return lambda: (registry.build(name), "auto", registry.example_input(name))


def _mlp():
    torch.manual_seed(0)
    return MLP(16, 64), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, torch.randn(8, 16)


def _titan_sp():
    """torchtitan's sequence-parallel plan: SequenceParallel norms, PrepareModuleInput, loss parallel."""
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=8, vocab_size=128))
    return model, torchtitan_tp_plan(model), torch.randint(0, 128, (4, 16))


CASES = {"llama": _hf("llama"), "gpt2": _hf("gpt2"), "mlp": _mlp, "titan_sp": _titan_sp}


def main_output(out):
    return out.logits if hasattr(out, "logits") else out


def loss_fn(module, x):
    return main_output(registry.run(module, x)).float().pow(2).mean()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    torch.manual_seed(0)
    model, plan, x = CASES[request.param]()
    ref = copy.deepcopy(model)
    xla_model, jm = both_backends(model, plan, AXES)
    return request.param, ref, xla_model, jm, x


def test_forward_matches_torch_cpu(case):
    _, ref, _, jm, x = case
    assert max_err(main_output(jm(x)), main_output(registry.run(ref, x))) < 1e-5


def test_gradients_match_torch_cpu_and_keep_the_shardings(case):
    _, ref, _, jm, x = case
    loss, grads = jm.value_and_grad(loss_fn)(jm.params, x)
    ref.zero_grad()
    ref_loss = loss_fn(ref, x)
    ref_loss.backward()
    assert abs(float(loss) - ref_loss.item()) < 1e-5
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        packing = packing_of(jm.module.get_parameter(name))  # a re-laid packed weight: compare in the original order
        got = to_torch(g) if packing is None else restore(to_torch(g), packing)
        assert max_err(got.reshape(ref_grads[name].shape), ref_grads[name]) < 1e-5, name
        assert g.sharding == jm.params[name].sharding, name


def test_every_parameter_is_placed_as_on_torch_xla(case):
    """Same device -> same block of every parameter (hence the same per-device shard shapes)."""
    _, _, xla_model, jm, _ = case
    xla_params = dict(xla_model.named_parameters())
    assert jm.params.keys() == xla_params.keys()
    sharded = 0
    for name, a in jm.params.items():
        assert jax_blocks(a) == xla_blocks(xla_params[name], 8), name
        assert a.sharding.shard_shape(a.shape) == next(iter(a.addressable_shards)).data.shape
        sharded += a.sharding.shard_shape(a.shape) != a.shape
    assert sharded >= 2, "the plan shards something"


def test_outputs_match_torch_xla(case):
    _, _, xla_model, jm, x = case
    out_xla = main_output(registry.run(xla_model, x.to(next(xla_model.parameters()).device)))
    assert max_err(main_output(jm(x)), out_xla) < 1e-5


def test_audits_agree(case):
    """Both compilers reach the plan's minimum with the same collectives and parameter memory."""
    name, _, xla_model, jm, x = case
    report = jm.audit(x)
    x_xla = x.to(next(xla_model.parameters()).device)
    xla_report = xla_tp.audit(xla_model, x_xla, mesh=xla_tp.make_mesh(**AXES))
    assert report.comm_minimum_bytes == xla_report.comm_minimum_bytes
    assert (report.param_bytes_per_device, report.param_bytes_total) == \
        (xla_report.param_bytes_per_device, xla_report.param_bytes_total)
    if name != "titan_sp":
        assert report.collectives == xla_report.collectives
        assert report.comm_ratio == 1.0 and report.compute_balance == 1.0
        return
    # Sequence parallel: the activations move identically; JAX's embedding lookup (a gather, torchax's
    # jnp.take) also re-tiles the token ids (small int32 all-gathers, collective-permutes).
    jax_colls = parse_collectives(jm.hlo(x))
    xla_colls = parse_collectives(capture_partitioned_hlo([xla_model(x_xla)]))
    assert activation_traffic(jax_colls) == activation_traffic(xla_colls)
    extra = [c for c in jax_colls if (c.kind, c.dtype) not in (("all-reduce", "f32"), ("all-gather", "f32"))]
    assert extra and all(c.kind == "collective-permute" or c.dtype == "s32" for c in extra), extra
    assert sum(c.bytes for c in extra) < 0.05 * report.comm_bytes



def test_backward_audits_agree():
    """Forward + backward of the HF Llama under "auto": the same minimum and FLOPs on both compilers,
    and the same activation traffic: column groups reduce their input gradient once on both (JAX
    differentiates the group's stacked forward). JAX's embedding gradient is still reduced at full
    size (torch_xla's is scattered per device); JAX's summed loss adds a scalar all-reduce or two,
    and reducing a group's stacked weight gradient at once gives it fewer, larger all-reduces."""
    model, x = registry.build("llama"), registry.example_input("llama")
    xla_model, jm = both_backends(model, "auto", AXES)
    report = jm.audit(x, backward=True)
    x_xla = x.to(next(xla_model.parameters()).device)
    xla_report = xla_tp.audit(xla_model, x_xla, mesh=xla_tp.make_mesh(**AXES), backward=True)
    assert report.comm_minimum_bytes == xla_report.comm_minimum_bytes == xla_report.comm_bytes
    assert report.flops_per_device == xla_report.flops_per_device
    assert report.count("all-gather") == xla_report.count("all-gather") == 0
    tp, hidden, vocab = AXES["model"], 64, 128
    embedding = (vocab - vocab // tp) * hidden * 4
    assert 0 <= report.comm_bytes - xla_report.comm_bytes - embedding <= 16, (report.collectives,
                                                                            xla_report.collectives)


def activation_traffic(colls):
    """Float all-reduces and all-gathers: (kind, count, bytes)."""
    return sorted({(k, sum(1 for c in colls if c.kind == k and c.dtype == "f32"),
                    sum(c.bytes for c in colls if c.kind == k and c.dtype == "f32"))
                   for k in ("all-reduce", "all-gather")})
