"""plan "auto" on every family that builds from a tiny config: Megatron-optimal and numerically right.

Each model (2 layers, 8 heads, hidden 64) runs on a 2x4 (data x model) mesh. The compiled forward
is audited (no all-gather, at most 2 all-reduces per layer + 2, communication at the plan's own
minimum, compute balance <= 1.10, at most 60% of the parameters on a device) and one training step
(forward, backward, SGD) is compared with the unsharded CPU model. A plan that splits nothing
fails three of these checks (its own test below). Encoders are built without their masked-LM head, whose
hidden x hidden transform feeds a LayerNorm and is computed whole by design (BERT's own test
below). Key/value heads are chosen to cover multi-query (1), grouped (2 < 4 devices: replicated)
and split (4) attention.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.distributed.spmd as xs

import xla_tp
from xla_tp.zoo.registry import LAYERS, build, example_input, positional_args, run

from ..helpers import max_err

KV = {"llama": 2, "mistral": 1, "qwen2": 2, "gemma": 1, "granite": 4, "starcoder2": 2, "falcon": 4, "phi3": 8,
      "glm": 2, "cohere": 8}
DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "cohere", "starcoder2", "stablelm",
            "glm", "phi3", "olmo", "phi", "gpt_neox", "falcon", "falcon_alibi", "mpt", "gptj", "codegen", "gpt2",
            "gpt_bigcode", "opt", "titan_llama", "cuda_llama"]
ENCODERS = ["bert", "roberta", "distilbert", "electra", "t5_encoder", "torch_encoder", "torch_mha", "mlp"]


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


def _failed_checks(report) -> list[str]:
    """The checks ``report`` fails of: no gather, 1 to 2 all-reduces per layer (+2), communication at the
    plan's minimum, compute split evenly (an upper bound on FLOPs per device), parameters split (at
    most 60% of the bytes on a device)."""
    checks = {"no all-gather": report.count("all-gather") == 0 and report.count("collective-permute") == 0,
              "all-reduces": 1 <= report.count("all-reduce") <= 2 * LAYERS + 2,
              "comm_ratio": report.comm_ratio == pytest.approx(1.0),
              "compute_balance": report.compute_balance <= 1.10,
              "param memory": report.param_bytes_per_device <= 0.6 * report.param_bytes_total}
    return [name for name, ok in checks.items() if not ok]


def test_a_plan_that_shards_nothing_fails_the_checks(mesh):
    """The checks above are lower bounds on what a plan splits, not only upper bounds on cost."""
    torch.manual_seed(0)
    model = xla_tp.parallelize_xla(build("llama", kv_heads=2), {}, mesh=mesh)
    x = example_input("llama").to(torch_xla.device())
    report = xla_tp.audit(model, *positional_args(model, x), mesh=mesh)
    assert set(_failed_checks(report)) >= {"all-reduces", "compute_balance", "param memory"}, report


def _objective(model, x):
    out = run(model, x)
    if out.dim() == 3 and out.shape[-1] == 128 and not x.is_floating_point():  # logits over the vocabulary
        return out, F.cross_entropy(out.flatten(0, 1).float(), x.flatten())
    return out, out.float().square().mean()


# the quick tier keeps one family of each kind the planner reads differently; the complete tier runs them all
QUICK = ("llama", "gemma", "falcon", "phi3", "gpt2", "gpt_bigcode", "opt", "titan_llama", "bert", "t5_encoder",
         "torch_mha", "mlp")


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.complete)
                                  for n in DECODERS + ENCODERS])
def test_auto_is_megatron_optimal_and_trains_like_cpu(name, mesh):
    torch.manual_seed(0)
    ref = build(name, kv_heads=KV.get(name, 8), head=name not in ENCODERS)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    x = example_input(name)
    xd = x.to(torch_xla.device())
    xs.mark_sharding(xd, mesh, ("data",) + (None,) * (x.dim() - 1))
    report = xla_tp.audit(model, *positional_args(model, xd), mesh=mesh)
    assert _failed_checks(report) == [], report

    out, loss = _objective(model, x.to(torch_xla.device()))
    ref_out, ref_loss = _objective(ref, x)
    for m, lo in ((model, loss), (ref, ref_loss)):
        lo.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch_xla.sync()
    assert max_err(out, ref_out) < 1e-4 and max_err(loss, ref_loss) < 1e-4
    want = ref.state_dict()  # state_dict: re-laid packed weights come back in their original order
    for n, p in model.state_dict().items():
        assert max_err(p, want[n]) < 1e-4, n
