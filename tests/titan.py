"""The tiny torchtitan Llama parallelized in one call or in several (root, then each block), and its audit.

``titan_single_call`` is a session fixture (imported by conftest): the one-call model's layout,
parameter shardings and forward+backward audit, shared by the multi-call and plain-script tests.
"""
import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.auditing.run import audit
from xla_tp import layout_of
from xla_tp.zoo.llama import Llama, LlamaArgs, torchtitan_tp_plan

BLOCK = "layers.*."


def split(plan: dict) -> tuple[dict, dict]:
    """A flat torchtitan plan -> (root plan, per-block plan with keys relative to a block)."""
    root = {k: v for k, v in plan.items() if not k.startswith(BLOCK)}
    block = {k[len(BLOCK):]: v for k, v in plan.items() if k.startswith(BLOCK)}
    return root, block


def titan(order: str):
    """The model with torchtitan's sequence-parallel plan on a data=2 x model=4 mesh, applied in one call
    (``"single"``) or as torch users do: ``"root_first"`` then each block, or ``"blocks_first"``."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    torch.manual_seed(0)
    model = Llama(LlamaArgs())
    plan = torchtitan_tp_plan(model, sequence_parallel=True)
    root, block = split(plan)
    if order == "single":
        xla_tp.parallelize_module(model, mesh, plan)
    for step in {"root_first": ("root", "blocks"), "blocks_first": ("blocks", "root")}.get(order, ()):
        if step == "root":
            xla_tp.parallelize_module(model, mesh, root)
        else:
            for layer in model.layers.values():
                xla_tp.parallelize_module(layer, mesh, block)
    return model, mesh


def settled(t: torch.Tensor) -> str:
    """The sharding string, read twice: torch_xla adopts an IR node's annotation into the tensor on a
    read and returns it only from the next one."""
    torch_xla._XLAC._get_xla_sharding_spec(t)
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def report_dict(model, mesh) -> dict:
    """The forward+backward audit (it holds the forward program too), notes left out."""
    tokens = torch.randint(0, 128, (4, 16)).to(torch_xla.device())
    out = audit(model, tokens, mesh=mesh, backward=True).to_dict()
    out.pop("notes")
    return out


@pytest.fixture(scope="session")
def titan_single_call():
    """(layout, parameter shardings, audit) of the one-call model."""
    model, mesh = titan("single")
    return layout_of(model), {n: settled(p) for n, p in model.named_parameters()}, report_dict(model, mesh)
