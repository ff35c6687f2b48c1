"""``parallelize_jax`` as the README shows it, in a fresh process with only the variables a user sets."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

README = """
import torch, torch.nn.functional as F
import xla_tp
from xla_tp.backends.jax import AdamW
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=128)
model = LlamaForCausalLM(cfg).eval()
tokens = torch.randint(0, 128, (4, 16))
fast_path = torch.backends.mha.get_fastpath_enabled()

jm = xla_tp.parallelize_jax(model, plan="auto", mesh={"data": 2, "model": 4})
logits = jm(tokens).logits                                   # a torch tensor
print(jm.params["model.layers.0.self_attn.q_proj.weight"].sharding.spec)
print(jm.audit(tokens))

def loss_fn(m, x):
    return F.cross_entropy(m(x, use_cache=False).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

loss, grads = jm.value_and_grad(loss_fn)(jm.params, tokens)
step = jm.train_step(loss_fn, AdamW(lr=1e-3))
losses = [float(step(tokens)) for _ in range(3)]

import jax
with torch.no_grad():
    ref = LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(jm.to_module().state_dict())
print("devices", len(jax.devices()), "logits", tuple(logits.shape), type(logits).__name__)
print("fast path kept", torch.backends.mha.get_fastpath_enabled() == fast_path)
print("loss falls", losses[0] > losses[-1], "grads", len(grads))
"""

NO_JAX = """
import sys
sys.modules["jax"] = None          # as if the [jax] extra were not installed
import torch, xla_tp
try:
    xla_tp.parallelize_jax(torch.nn.Linear(4, 4), mesh={"model": 1})
except ImportError as e:
    print("ImportError:", e)
"""


def _run(script: str) -> str:
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_readme_example_in_a_fresh_process():
    out = _run(README)
    assert "PartitionSpec('model', None)" in out
    assert "all-reduce  5" in out and "all-gather" not in out          # embedding + 2 per layer
    assert "devices 8 logits (4, 16, 128) Tensor" in out                # jax got CPU_NUM_DEVICES devices
    assert "fast path kept True" in out
    assert "loss falls True grads 21" in out


def test_without_the_jax_extra_the_error_says_what_to_install():
    assert "pip install 'xla_tp[jax]'" in _run(NO_JAX)


FLAX_AT_IMPORT = """
import sys
sys.path.insert(0, sys.argv[1])
from xla_tp.backends.jax.runtime import import_torchax
torchax = import_torchax()
print("flax left behind", any(name.split(".")[0] == "flax" for name in sys.modules))
try:
    torchax.checkpoints.restore_checkpoint
except ImportError as e:
    print("ImportError:", e)
"""


def test_a_torchax_build_that_imports_flax_at_import_time(tmp_path):
    """Some torchax 0.0.13 builds on package indexes import flax on import; flax is not a dependency."""
    (tmp_path / "torchax").mkdir()
    (tmp_path / "torchax" / "__init__.py").write_text("from flax.training import checkpoints\n")
    (tmp_path / "torchax" / "interop.py").write_text("")
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    result = subprocess.run([sys.executable, "-c", FLAX_AT_IMPORT, str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flax left behind False" in result.stdout
    assert "pip install flax" in result.stdout
