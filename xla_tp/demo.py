"""The main job: a small Llama, parallelized on emulated devices, checked against itself unsharded.

Reads ``recipes/default.yaml`` (command-line flags override it), builds the torchtitan-style Llama of ``xla_tp.zoo.llama`` on the CPU, copies it, applies
torchtitan's TP plan (sequence parallel, loss parallel) on a ``data x model`` mesh of emulated
devices, prints the per-parameter sharding table, then the max error of the logits, the loss, the
gradients and the parameters after one SGD step against the unsharded CPU model. Run::

    python -m xla_tp.demo                       # recipes/default.yaml
    python -m xla_tp.demo --mesh model=8 --plan megatron
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch_xla
import yaml

from .api import parallelize_xla
from .mesh import ensure_runtime, make_mesh
from .report import format_table, sharding_rows
from .zoo.llama import Llama, LlamaArgs, megatron_tp_plan, torchtitan_tp_plan


def parse_mesh(text: str) -> dict[str, int]:
    """``parse_mesh("data=2,model=4") == {"data": 2, "model": 4}``."""
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: write axis=size pairs, e.g. data=2,model=4") from None


def train_step(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """One next-token SGD step; returns logits, loss, gradients and updated parameters.

    (SGD, not Adam: Adam's first step is ``lr * sign(grad)`` and turns float noise on gradients
    near zero into full-size differences; the AdamW comparison lives in the tests, on an MLP.)
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    if tokens.device.type == "xla":
        torch_xla.sync()  # one program for everything, not one per .cpu() read
    return {"logits": [logits.detach()], "loss": [loss.detach()], "grads": grads,
            "params": [p.detach() for p in model.parameters()]}


PLANS = {
    "torchtitan": lambda m: torchtitan_tp_plan(m),
    "torchtitan_no_sp": lambda m: torchtitan_tp_plan(m, sequence_parallel=False, loss_parallel=False),
    "megatron": lambda m: megatron_tp_plan(),
}
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"


def load_recipe(path: Path, overrides: dict) -> dict:
    """The recipe's settings, with command-line values (not None) taking precedence."""
    if not path.is_file():
        raise SystemExit(f"--recipe {path}: no such file")
    recipe = yaml.safe_load(path.read_text()) or {}
    recipe.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(recipe.get("mesh"), str):
        recipe["mesh"] = parse_mesh(recipe["mesh"])
    if recipe.get("plan") not in PLANS:
        raise SystemExit(f"recipe {path}: plan {recipe.get('plan')!r} is not one of {sorted(PLANS)}")
    return recipe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="YAML recipe (recipes/default.yaml)")
    ap.add_argument("--mesh", help="axis=size pairs (data, fsdp, model), e.g. data=2,model=4")
    ap.add_argument("--plan", help=f"one of {sorted(PLANS)}")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--tolerance", type=float, help="fail above this max error")
    args = vars(ap.parse_args(argv))
    recipe = load_recipe(args.pop("recipe"), args)

    ensure_runtime()  # before any CPU backward (FACTS.md: the CPU-backward trap)
    torch.manual_seed(0)
    ref = Llama(LlamaArgs(**recipe["model"]))
    model = copy.deepcopy(ref)
    mesh = make_mesh(**recipe["mesh"])
    t0 = time.perf_counter()
    parallelize_xla(model, PLANS[recipe["plan"]](model), mesh=mesh)
    print(f"[xla_tp] parallelized in {time.perf_counter() - t0:.2f}s on mesh "
          f"{dict(zip(mesh.axis_names, mesh.mesh_shape))}\n")
    print(format_table(sharding_rows(model, mesh)), "\n")

    tokens = torch.randint(0, ref.tok_embeddings.num_embeddings, (recipe["batch"], recipe["seq"]))
    ref_run = train_step(ref, tokens)
    tp_run = train_step(model, tokens.to(torch_xla.device()))
    errors = {what: max((r - t.cpu()).abs().max().item() for r, t in zip(ref_run[what], tp_run[what]))
              for what in ref_run}
    for what, err in errors.items():
        print(f"max |{what} - ref| = {err:.2e}")
    worst = max(errors.values())
    ok = worst <= recipe["tolerance"]
    print("OK" if ok else f"FAILED: error {worst:.2e} > {recipe['tolerance']:.0e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
