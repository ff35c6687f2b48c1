"""Training at scale on an fsdp x model mesh: CPU-exact losses with every parameter and optimizer
state sharded over both axes, torchao's optimizers, and activation checkpointing."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torchao.optim as torchao_optim  # the [test] extra installs torchao==0.14.1
from torch.utils.checkpoint import checkpoint

import xla_tp
from xla_tp import layout_of
from xla_tp.zoo.registry import VOCAB, build, run

from ..helpers import MLP, expected_sharding, grads, max_err, sharding

FSDP_TP = dict(fsdp=2, model=4)


def _loss(model, tokens):
    logits = run(model, tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _axes(spec):
    return {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}


def test_five_adamw_steps_match_cpu_with_everything_sharded_over_both_axes():
    """``fused=True`` (transformers' ``Trainer`` default): torch's fused kernel refuses XLA parameters; xla_tp runs
    the same update unfused there (XLA fuses the compiled step), equal to the CPU's fused kernel."""
    torch.manual_seed(0)
    ref = build("llama").train()
    model = copy.deepcopy(ref)
    mesh = xla_tp.make_mesh(**FSDP_TP)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-3, fused=True) for m in (model, ref)]
    tokens = torch.randint(0, VOCAB, (4, 16))
    losses = {"xla": [], "cpu": []}
    for _ in range(5):
        for key, m, opt, t in (("xla", model, opts[0], tokens.to(torch_xla.device())), ("cpu", ref, opts[1], tokens)):
            loss = _loss(m, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            losses[key].append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses["xla"], losses["cpu"])) < 1e-4, losses
    assert losses["xla"][-1] < losses["xla"][0]
    specs = layout_of(model).params
    for name, p in model.named_parameters():
        spec = specs[name]
        assert _axes(spec) == ({"fsdp", "model"} if p.dim() == 2 else {"fsdp"}), (name, spec)  # norms: 1-D
        assert sharding(p) == expected_sharding(tuple(p.shape), mesh, spec), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert sharding(opts[0].state[p][key]) == sharding(p), (name, key)
    assert [g["fused"] for g in opts[0].param_groups] == [False] and opts[1].param_groups[0]["fused"]


@pytest.fixture(scope="module")
def bf16_llama():
    torch.manual_seed(0)
    model = build("llama").train().to(torch.bfloat16)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(**FSDP_TP))
    return model


def test_torchao_bf16_stochastic_rounding_adamw(bf16_llama):
    # lr 1e-2 overshot on the third step for one device RNG state in six (the rounding is random)
    opt = torchao_optim._AdamW(bf16_llama.parameters(), lr=3e-3, bf16_stochastic_round=True)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0)).to(torch_xla.device())
    losses = []
    for _ in range(3):
        loss = _loss(bf16_llama, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0], losses
    assert not torch.compiler.is_compiling() and torch._dynamo.eval_frame._stance.stance == "default"
    for name, p in bf16_llama.named_parameters():
        assert p.dtype == torch.bfloat16
        for key in ("exp_avg", "exp_avg_sq"):
            assert sharding(opt.state[p][key]) == sharding(p), (name, key)


def test_torchao_8bit_adamw_is_refused_before_touching_anything(bf16_llama):
    opt = torchao_optim.AdamW8bit(bf16_llama.parameters(), lr=1e-2)
    _loss(bf16_llama, torch.randint(0, VOCAB, (4, 16), device=torch_xla.device())).backward()
    before = {n: p.detach().cpu().clone() for n, p in bf16_llama.named_parameters()}
    with pytest.raises(xla_tp.OptimizerError, match=r"AdamW8bit .*torchao.optim._AdamW\(params, bf16_stochastic_round=True\)"):
        opt.step()
    assert not opt.state
    for n, p in bf16_llama.named_parameters():
        assert torch.equal(p.detach().cpu(), before[n]), n
    bf16_llama.zero_grad()


def _llama_step(checkpointing: bool):
    torch.manual_seed(0)
    ref = build("llama").train()
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(**FSDP_TP))
    if checkpointing:
        model.gradient_checkpointing_enable()
    return ref, model


def test_hf_gradient_checkpointing_matches_cpu_and_recomputes():
    ref, model = _llama_step(checkpointing=True)
    tokens = torch.randint(0, VOCAB, (4, 16))
    _loss(model, tokens.to(torch_xla.device())).backward()
    _loss(ref, tokens).backward()
    g, g_ref = grads(model), grads(ref)
    assert g.keys() == g_ref.keys()
    assert max(max_err(g[n], g_ref[n]) for n in g_ref) < 1e-5
    plain = _llama_step(checkpointing=False)[1]
    x = tokens.to(torch_xla.device())
    recomputed = xla_tp.audit(model, x, backward=True).flops_per_device
    kept = xla_tp.audit(plain, x, backward=True).flops_per_device
    forward = xla_tp.audit(plain, x).flops_per_device
    # the backward replays each checkpointed decoder layer's forward: more dot FLOPs, less than a whole forward
    assert kept < recomputed < kept + forward, (kept, recomputed, forward)


class CheckpointedMLP(MLP):
    def __init__(self, reentrant: bool):
        super().__init__(16, 64)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_utils_checkpoint_in_user_modules(reentrant):
    torch.manual_seed(0)
    ref = CheckpointedMLP(reentrant)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, {"fc1": xla_tp.ColwiseParallel(), "fc2": xla_tp.RowwiseParallel()},
                           mesh=xla_tp.make_mesh(**FSDP_TP))
    x = torch.randn(8, 16, requires_grad=True)
    model(x.detach().to(torch_xla.device()).requires_grad_()).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    g, g_ref = grads(model), grads(ref)
    assert max(max_err(g[n], g_ref[n]) for n in g_ref) < 1e-5


def test_lazy_stochastic_rounding_is_unbiased_between_bf16_neighbours():
    from xla_tp.optim import stochastic_round_to_bf16
    x = torch.full((4096,), 1.0 + 3 * 2.0 ** -10)  # between bf16 neighbours 1 + 2**-7 * {0, 1}, 3/8 of the way
    out = stochastic_round_to_bf16(x.to(torch_xla.device())).cpu()
    assert out.dtype == torch.bfloat16
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert abs(out.float().mean().item() - x[0].item()) < 2e-4  # unbiased: E[out] = x
