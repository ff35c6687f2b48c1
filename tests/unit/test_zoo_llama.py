"""CPU tests for the reference Llama in xla_tp.zoo.llama (no torch_xla needed)."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.nn.functional as F

from xla_tp.zoo.llama import Llama, LlamaArgs, megatron_tp_plan, torchtitan_tp_plan


def _tokens(args: LlamaArgs, b: int = 2, s: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (b, s), generator=g)


def _matches(key: str, fqn: str) -> bool:
    """torch parallelize_module-style matching: fnmatch each '.'-separated segment."""
    k, f = key.split("."), fqn.split(".")
    return len(k) == len(f) and all(fnmatch.fnmatch(a, p) for p, a in zip(k, f))


def test_forward_shape() -> None:
    args = LlamaArgs()
    logits = Llama(args)(_tokens(args, 3, 10))
    assert logits.shape == (3, 10, args.vocab_size)
    assert torch.isfinite(logits).all()


def test_module_names() -> None:
    names = dict(Llama(LlamaArgs()).named_modules())
    for n in ["tok_embeddings", "layers.0.attention.wq", "layers.1.feed_forward.w3",
              "layers.0.attention_norm", "layers.0.ffn_norm", "norm", "output"]:
        assert n in names
    assert "rope" not in Llama(LlamaArgs()).state_dict()


def test_causal() -> None:
    torch.manual_seed(0)
    args = LlamaArgs()
    model = Llama(args).eval()
    tok = _tokens(args)
    tok2 = tok.clone()
    tok2[:, 10:] = (tok2[:, 10:] + 1) % args.vocab_size
    with torch.no_grad():
        a, b = model(tok), model(tok2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_runs() -> None:
    args = LlamaArgs(n_kv_heads=2)
    model = Llama(args)
    assert model.layers["0"].attention.wk.out_features == 2 * args.dim // args.n_heads
    assert model(_tokens(args)).shape == (2, 16, args.vocab_size)


def test_deterministic() -> None:
    args = LlamaArgs()
    torch.manual_seed(42)
    m1 = Llama(args)
    torch.manual_seed(42)
    m2 = Llama(args)
    tok = _tokens(args)
    torch.testing.assert_close(m1(tok), m2(tok), rtol=0, atol=0)


def test_meta_materialisation() -> None:
    args = LlamaArgs()
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    torch.testing.assert_close(model.rope, Llama(args).rope)
    assert torch.isfinite(model(_tokens(args))).all()


@pytest.mark.parametrize(
    "plan",
    [
        torchtitan_tp_plan(Llama(LlamaArgs())),
        torchtitan_tp_plan(Llama(LlamaArgs()), loss_parallel=False),
        torchtitan_tp_plan(Llama(LlamaArgs()), sequence_parallel=False),
        megatron_tp_plan(),
    ],
    ids=["titan", "titan_no_lp", "titan_no_sp", "megatron"],
)
def test_plan_keys_match_modules(plan: dict) -> None:
    fqns = [n for n, _ in Llama(LlamaArgs()).named_modules() if n]
    for key in plan:
        assert any(_matches(key, f) for f in fqns), key


def test_titan_plan_contents() -> None:
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel
    from torch.distributed.tensor.placement_types import Replicate, Shard

    plan = torchtitan_tp_plan(Llama(LlamaArgs()))
    assert len(plan) == 14
    assert plan["tok_embeddings"].output_layouts == (Shard(1),)
    assert isinstance(plan["norm"], SequenceParallel)
    attn = plan["layers.*.attention"]
    assert isinstance(attn, PrepareModuleInput)
    assert attn.input_layouts == (Shard(1), None) and attn.desired_input_layouts == (Replicate(), None)
    assert plan["output"].output_layouts == (Shard(-1),) and not plan["output"].use_local_output
    no_sp = torchtitan_tp_plan(Llama(LlamaArgs()), sequence_parallel=False, loss_parallel=False)
    assert len(no_sp) == 9 and "norm" not in no_sp
    assert no_sp["output"].input_layouts == (Replicate(),) and no_sp["output"].use_local_output
    assert set(megatron_tp_plan()) <= set(plan)


def test_loss_backward() -> None:
    torch.manual_seed(0)
    args = LlamaArgs(n_kv_heads=2)
    model = Llama(args)
    tok = _tokens(args)
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers["0"].attention.wq.weight.grad.abs().sum() > 0
