"""``unparallelize``: a parallelized model becomes a plain one on the device, computing what it computed."""
import copy
import io

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.lowering import scope
from xla_tp.zoo.registry import build, example_input, run

from ..helpers import max_err, sharding


def test_a_plain_model_again_with_the_same_outputs():
    """GPT-2 (a packed c_attn "auto" re-lays device-major, a tied table) on 2x4: after ``unparallelize``
    the weights are back in their original order and replicated, no hook or record of xla_tp is left,
    and the model computes the CPU model's logits; parallelizing it again works."""
    torch.manual_seed(0)
    ref = build("gpt2")
    model = copy.deepcopy(ref)
    mesh = xla_tp.make_mesh(data=2, model=4)
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks)) for m in model.modules()]
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    assert xla_tp.state_of(model).relaid  # c_attn re-laid
    x = example_input("gpt2")
    want = run(ref, x)
    assert max_err(run(model, x.to(torch_xla.device())), want) < 1e-4
    xla_tp.unparallelize(model)
    assert xla_tp.state_of(model) is None and xla_tp.layout_of(model) is None
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks)) for m in model.modules()] == hooks
    assert not any(hasattr(p, "_xla_tp") for p in model.parameters())
    assert all(sharding(p) in ("", "{replicated}") for p in model.parameters())
    state = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert max(max_err(state[n], p) for n, p in ref.named_parameters()) == 0.0  # original order, same values
    assert max_err(run(model, x.to(torch_xla.device())), want) < 1e-4
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    assert max_err(run(model, x.to(torch_xla.device())), want) < 1e-4


def test_a_block_inside_a_parallelized_model_is_made_plain_and_the_model_still_runs():
    """torch's idiom parallelizes the root, then each block; unparallelizing one block leaves the rest, and
    the model finds its lowering again at the next forward."""
    torch.manual_seed(0)
    ref = build("titan_llama")
    model = copy.deepcopy(ref)
    plan = xla_tp.plan_for(model, mesh={"model": 8})
    xla_tp.parallelize_xla(model, plan, mesh=xla_tp.make_mesh(model=8))
    block = model.layers["0"]
    xla_tp.unparallelize(block)
    assert not any(hasattr(p, "_xla_tp") for p in block.parameters())
    assert all(len(m._forward_hooks) + len(m._forward_pre_hooks) == 0 for m in block.modules())
    assert xla_tp.state_of(model).pending
    x = example_input("titan_llama")
    assert max_err(run(model, x.to(torch_xla.device())), run(ref, x)) < 1e-4
    assert not xla_tp.state_of(model).pending


def test_copying_or_moving_a_parallelized_model_is_refused_until_it_is_plain_again():
    """A parallelized GPT-2 holds c_attn re-laid device-major: a deep copy, a pickle (``torch.save(model)``)
    or the model moved to the CPU would compute something else with no state to read it. Each is refused
    naming the fix and the model still computes the CPU model's logits; once unparallelized, the copy and
    the move work and compute them too."""
    torch.manual_seed(0)
    ref = build("gpt2")
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    x = example_input("gpt2")
    want = run(ref, x)
    for attempt in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(xla_tp.PlanError, match="cannot be copied or pickled.*copy it before parallelize_xla"):
            attempt()
    assert max_err(run(model, x.to(torch_xla.device())), want) < 1e-4
    torch.save(model.state_dict(), io.BytesIO())  # the state dict is the model's own layout: allowed
    model.to("cpu")
    with pytest.raises(xla_tp.PlanError, match="parameters are on cpu: call xla_tp.unparallelize"):
        run(model, x)
    assert scope.depth() == 0  # the refused forward left no parallelized model "running" behind it
    xla_tp.unparallelize(model)
    assert max_err(run(copy.deepcopy(model), x), want) < 1e-4 and max_err(run(model, x), want) < 1e-4


def test_each_rewrite_is_owned_by_its_modules_and_goes_with_them(tiny_llama):
    """The lowering lives on the modules that own a rewrite: q/k/v and gate/up run as their lowered class, the
    attention's function inside the mode, all listed in ``explain()``; ``unparallelize`` gives every module its
    own class back. (torch's functions staying torch's own: tests/user_paths/test_scoped.py.)"""
    model = xla_tp.parallelize_xla(tiny_llama(), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for member in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, model.model.embed_tokens):
        assert type(member).__bases__ in ((torch.nn.Linear,), (torch.nn.Embedding,)), type(member).__mro__
    assert type(attn.o_proj) is torch.nn.Linear and type(mlp.down_proj) is torch.nn.Linear  # nothing to rewrite
    text = xla_tp.state_of(model).explain()
    assert "rewrites owned by (attention (transformers' AttentionInterface)): ['model.layers.0.self_attn'" in text
    assert "'model.layers.0.self_attn.q_proj'" in text
    xla_tp.unparallelize(model)
    assert type(attn.q_proj) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
