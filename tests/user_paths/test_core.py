"""The core without torch_xla: ``import xla_tp``, the planner, ``torch_plan`` and the JAX backend in a Python
that cannot import torch_xla (a fresh process where ``import torch_xla`` fails, as where it is not installed).

The torch_xla entry points raise, when called, an ``ImportError`` saying what to install; nothing imports
torch_xla. The same file runs in the torch_xla-free environment of ``bash scripts/dev.sh complete``
(torch 2.11; no JAX there: that part says so and is left out).
"""
from __future__ import annotations

import json
import textwrap

import pytest

from ..fresh import run_fresh

pytestmark = pytest.mark.core

SCRIPT = textwrap.dedent('''
    import importlib.util, json, sys
    sys.modules["torch_xla"] = None      # import torch_xla fails, as where it is not installed
    import torch, transformers
    import xla_tp
    out = {"has_torch_xla": xla_tp.has_torch_xla()}
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        llama_8b = transformers.LlamaForCausalLM(config)
    plan = xla_tp.plan_for(llama_8b, mesh={"data": 2, "model": 4})
    out["roles"] = [plan[k].role for k in ("model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj", "lm_head")]
    styles = xla_tp.torch_plan(llama_8b, mesh={"model": 4})
    out["torch_styles"] = sorted({type(s).__name__ for s in styles.values()})
    out["torch_modules"] = len(styles)
    errors = []
    for name in ("parallelize_xla", "make_mesh", "audit", "generate", "save_checkpoint"):
        try:
            getattr(xla_tp, name)()
        except ImportError as e:
            errors.append(str(e))
    out["errors"] = errors
    if importlib.util.find_spec("jax") is not None:
        torch.manual_seed(0)
        small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=128)).eval()
        jm = xla_tp.parallelize_jax(small, "auto", mesh={"data": 2, "model": 4})
        ids = torch.randint(0, 128, (4, 16))
        with torch.no_grad():
            out["jax_error"] = (jm(ids).logits - small(ids, use_cache=False).logits).abs().max().item()
        out["jax_q_spec"] = str(jm.params["model.layers.0.self_attn.q_proj.weight"].sharding.spec)
    import copy, socket, torch.distributed as dist
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=128)).eval()
    styled = xla_tp.parallelize_dtensor(copy.deepcopy(tiny), "auto")
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        out["dtensor_error"] = (styled(input_ids=ids).logits - tiny(input_ids=ids).logits).abs().max().item()
    out["dtensor_q"] = type(styled.model.layers[0].self_attn.q_proj.weight.data).__name__
    dist.destroy_process_group()
    out["torch_xla_loaded"] = sorted(m for m, v in sys.modules.items() if m.startswith("torch_xla") and v is not None)
    print("JSON" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def without_torch_xla() -> dict:
    out = run_fresh(SCRIPT, timeout=900)
    return json.loads(next(line[4:] for line in out.splitlines() if line.startswith("JSON")))


def test_the_planner_and_torch_styles_need_no_torch_xla(without_torch_xla):
    got = without_torch_xla
    assert got["has_torch_xla"] is False and got["torch_xla_loaded"] == []
    assert got["roles"] == ["column-parallel", "row-parallel", "vocab-parallel output head"]
    # 32 layers x 7 projections, the embedding and the head, each in one of torch's styles
    assert got["torch_modules"] == 32 * 7 + 2 and got["torch_styles"] == ["ColwiseParallel", "RowwiseParallel"]


def test_torch_xla_entry_points_say_what_to_install(without_torch_xla):
    errors = without_torch_xla["errors"]
    assert len(errors) == 5
    for error, name in zip(errors, ("parallelize_xla", "make_mesh", "audit", "generate", "save_checkpoint")):
        assert error.startswith(f"xla_tp.{name} runs on XLA devices and needs torch_xla") and "torch_xla==2.9.0" in error


def test_the_jax_backend_runs_without_torch_xla(without_torch_xla):
    if "jax_error" not in without_torch_xla:
        pytest.skip("jax is not installed in this environment (the torch_xla-free one has torch and transformers "
                    "only); the main environment runs this")
    assert without_torch_xla["jax_error"] < 1e-4
    assert without_torch_xla["jax_q_spec"] == "PartitionSpec('model', None)"


def test_parallelize_dtensor_runs_without_torch_xla(without_torch_xla):
    """torch's own DTensor route (TorchTPU's): a one-process gloo group, "auto" in torch's styles."""
    assert without_torch_xla["dtensor_q"] == "DTensor"
    assert without_torch_xla["dtensor_error"] < 1e-5
