"""Shared test helpers: compiled-program reading, sharding strings, reference comparison."""
from __future__ import annotations

import copy

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from xla_tp import compat
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.auditing.hlo import collective_summary, parse_collectives
from xla_tp.lowering import owners, scope
from xla_tp.plan.layout import Layout
from xla_tp.state import ModelState, register


def collective_counts(tensors) -> dict[str, int]:
    """Collective op kind -> count in the post-partition HLO computing ``tensors``."""
    text = capture_partitioned_hlo(list(tensors))
    return {k: v["count"] for k, v in collective_summary(parse_collectives(text)).items()}


def sharding(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def expected_sharding(shape, mesh: xs.Mesh, spec) -> str:
    """The sharding string a fresh tensor of ``shape`` gets under ``spec``."""
    t = torch.zeros(shape, device=torch_xla.device())
    xs.mark_sharding(t, mesh, spec)
    return sharding(t)


def twin(module_cls, *args, seed: int = 0, **kwargs):
    """Two identical CPU modules: (reference, to_parallelize)."""
    torch.manual_seed(seed)
    ref = module_cls(*args, **kwargs)
    return ref, copy.deepcopy(ref)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().cpu().float() - b.detach().cpu().float()).abs().max().item()


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All gradients on the CPU. One ``sync`` first: reading pending XLA tensors one by one would
    compile one program per tensor."""
    torch_xla.sync()
    return {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}


class MLP(torch.nn.Module):
    """fc1 (colwise) -> relu -> fc2 (rowwise)."""

    def __init__(self, dim: int = 16, hidden: int = 32, bias: bool = True):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden, bias=bias)
        self.fc2 = torch.nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight ``[vocab, dim]``."""

    def __init__(self, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def snapshot(model: torch.nn.Module):
    """Everything parallelize_xla could change: tensors (identity, device, values), hooks, forward."""
    return ([(n, id(t), t.device, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()],
            [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()],
            "forward" in vars(model))


def assert_unchanged(model: torch.nn.Module, snap) -> None:
    now = snapshot(model)
    assert [(n, i, d) for n, i, d, _ in now[0]] == [(n, i, d) for n, i, d, _ in snap[0]]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(now[0], snap[0]))
    assert now[1:] == snap[1:]


def lowered_forward(module: torch.nn.Module, mesh: xs.Mesh, tp: int) -> ModelState:
    """Make ``module``'s forward a parallelized one (the lowering acts in it and its backward), with
    nothing planned: for tests of one lowering piece at a time."""
    state = ModelState(Layout(tp_axis="model", batch_axes=()), mesh, tp)
    state.lease = compat.lease()
    register(module, state, state.lease.release)
    scope.install_root(module, state, None)
    owners.install(module, state, {"": "everything"}, set())  # the lowering mode around its whole forward
    scope.install_exit(module, state)
    return state
