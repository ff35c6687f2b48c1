"""Training on the JAX backend: AdamW steps match torch's, shardings survive, weights come back."""
import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import xla_tp
from xla_tp.backends.jax import AdamW
from xla_tp.zoo import registry

from .. import moe_models
from ..helpers import max_err
from ..helpers_jax import ensure_cpu_devices  # noqa: F401  (jax's 8 devices first)

AXES = {"data": 2, "model": 4}


def lm_loss(module, tokens):
    logits = module(tokens, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.fixture(scope="module")
def trained():
    """Two AdamW steps on the tiny Llama (embedding frozen) on both sides."""
    torch.manual_seed(0)
    model = registry.build("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    jm = xla_tp.parallelize_jax(model, "auto", mesh=AXES)
    frozen = jm.params["model.embed_tokens.weight"]
    step = jm.train_step(lm_loss, AdamW(lr=1e-3, weight_decay=0.1))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    losses = []
    for seed in (1, 2):
        tokens = registry.example_input("llama", seed=seed)
        opt.zero_grad()
        ref_loss = lm_loss(ref, tokens)
        ref_loss.backward()
        opt.step()
        losses.append((float(step(tokens)), ref_loss.item()))
    return jm, ref, step, losses, frozen


def test_adamw_arithmetic_is_torchs():
    """Same gradients in, same parameters out, over three steps (with weight decay)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt_ref = torch.optim.AdamW(ref.values(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    opt = AdamW(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    current = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    state = opt.init(current)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k]
        opt_ref.step()
        updates, state = opt.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state, current)
        current = {k: current[k] + updates[k] for k in current}
    for k, p in ref.items():
        assert max_err(torch.from_numpy(np.array(current[k])), p) < 1e-6, k


def test_losses_and_parameters_match_torch_adamw(trained):
    """Through the jitted step. Adam divides by the gradient's size, so last-bit differences in tiny
    gradients move a parameter by up to lr/10; a missed or misplaced update moves it by ~lr."""
    jm, ref, _, losses, _ = trained
    for jax_loss, ref_loss in losses:
        assert abs(jax_loss - ref_loss) < 1e-5
    assert losses[1][0] < losses[0][0]
    module = jm.to_module()
    ref_state = ref.state_dict()
    for name, t in module.state_dict().items():
        assert max_err(t, ref_state[name]) < 1e-4, name


def test_parameters_and_optimizer_state_keep_their_shardings(trained):
    jm, _, step, _, _ = trained
    planned = 0
    for name, a in jm.params.items():
        assert a.sharding == jm.sharding(name), name
        planned += a.sharding.spec != ()
    for moments in (step.state.mu, step.state.nu):
        assert moments.keys() == jm.params.keys() - {"model.embed_tokens.weight"}
        for name, m in moments.items():
            assert m.sharding == jm.sharding(name), name
    assert planned >= 10 and int(step.state.count) == 2


def test_frozen_parameters_are_not_updated(trained):
    jm, _, step, _, frozen = trained
    assert jm.params["model.embed_tokens.weight"] is frozen
    assert "model.embed_tokens.weight" not in step.state.mu


def test_to_module_gives_the_trained_torch_model(trained):
    jm, _, _, _, _ = trained
    tokens = registry.example_input("llama", seed=3)
    with torch.no_grad():
        expected = jm.to_module()(tokens, use_cache=False).logits
    assert max_err(jm(tokens).logits, expected) < 1e-5


def test_moe_model_with_eager_experts_runs_and_keeps_experts_split():
    """transformers' eager experts (``nonzero``: no static shape under jit) run as its batched ones, in the
    program and in the audit."""
    torch.manual_seed(0)
    model = moe_models.build("mixtral").eval()  # experts_implementation="eager"
    tokens = torch.randint(0, 128, (4, 16))
    with torch.no_grad():
        ref = model(tokens).logits
    jm = xla_tp.parallelize_jax(model, "auto", mesh=AXES)
    assert max_err(jm(tokens).logits, ref) < 1e-4
    assert model.config._experts_implementation == "eager"  # put back after the traced call
    assert jm.params["model.layers.0.mlp.experts.down_proj"].sharding.spec[0] == "model"  # expert-parallel
    report = jm.audit(tokens)  # its recorder runs them as batched ones too (eager's nonzero fails on fake tensors)
    assert report.count("all-reduce") >= 3 and report.compute_balance is not None
