"""xla_tp's effects stay on the models it parallelized, and go away with them.

Each test runs in a fresh process (the suite holds parallelized models in fixtures, which keep the
effects installed): an unrelated CPU model and an unrelated XLA model compute bit for bit what they
compute in a process where xla_tp was never imported, and torch's functions are the originals again
once no parallelized model remains.
"""
from __future__ import annotations

import json

from ..fresh import run_fresh

UNRELATED = '''
import hashlib, json, torch, torch_xla, torch_xla.runtime as xr
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = torch.nn.LayerNorm(32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.emb = torch.nn.Embedding(64, 32)
    def forward(self, ids):
        x = self.emb(ids)
        q, k, v = self.qkv(self.norm(x)).view(*x.shape[:2], 3, 4, 8).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2))
        return self.out(a.transpose(1, 2).flatten(2)) + s.mean() + x[:, -8:, :].sum()

def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

def run(device, compiled):
    torch.manual_seed(0)
    block = Block().to(device)
    ids = torch.randint(0, 64, (2, 16)).to(device)
    fn = torch.compile(block, backend="openxla" if device != "cpu" else "aot_eager") if compiled else block
    # torch.utils.checkpoint on XLA fails without xla_tp (torch_xla registers no torch.xla): CPU only
    y = checkpoint(fn, ids, use_reentrant=False) if device == "cpu" and not compiled else fn(ids)
    y.square().sum().backward()
    if device != "cpu":
        torch_xla.sync()
    return digest(y, *[p.grad for p in block.parameters()])

def hf_moe():
    """A transformers MoE model on the CPU (its attention and experts come from transformers' registries, its
    auxiliary loss counts with histc): logits, loss and every gradient."""
    import transformers
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=64, output_router_logits=True))
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return digest(out.logits, out.loss, out.aux_loss, *[p.grad for p in model.parameters() if p.grad is not None])

def unrelated():
    xla = torch_xla.device()
    return {"cpu": run("cpu", False), "cpu_compiled": run("cpu", True),
            "xla": run(xla, False), "xla_compiled": run(xla, True), "cpu_moe": hf_moe()}
'''

NEVER_IMPORTED = UNRELATED + '''
xr.use_spmd()
(torch.ones(1, device=torch_xla.device()) * 2).cpu()
assert not any(m.startswith("xla_tp") for m in __import__("sys").modules)
print(json.dumps(unrelated()))
'''

BESIDE_A_PARALLELIZED_MODEL = UNRELATED + '''
import transformers  # loaded first: the effects on its registries are installed with the others
import xla_tp
from xla_tp import compat
mesh = xla_tp.make_mesh(data=2, model=4)
mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
model = xla_tp.parallelize_xla(mlp, "auto", mesh=mesh)
model(torch.randn(4, 8, 32).to(torch_xla.device())).sum().backward()
torch_xla.sync()
assert {"histc", "dynamo_bridge", "attention_interface", "experts_interface"} <= set(compat.installed())
print(json.dumps(unrelated()))
'''


def test_unrelated_models_compute_what_they_compute_without_xla_tp():
    """CPU and XLA, eager (CPU with torch.utils.checkpoint) and torch.compile: SDPA, 4-D matmul, LayerNorm,
    an embedding and a slice, and a transformers MoE model on the CPU (its auxiliary loss included), after another
    model was parallelized (its effects installed), bit for bit as in a process that never imported xla_tp."""
    alone = json.loads(run_fresh(NEVER_IMPORTED, fast_compile=True).strip().splitlines()[-1])
    beside = json.loads(run_fresh(BESIDE_A_PARALLELIZED_MODEL, fast_compile=True).strip().splitlines()[-1])
    assert beside == alone


ORIGINALS = '''
import gc, json, torch, torch_xla
import torch.nn.functional as F
import torch.optim.optimizer as optimizer
from torch_xla._dynamo import dynamo_bridge

def current():
    return {"sdpa": F.scaled_dot_product_attention, "matmul": torch.matmul, "tensor_matmul": torch.Tensor.matmul,
            "at": torch.Tensor.__matmul__, "mha": F.multi_head_attention_forward, "layer_norm": F.layer_norm,
            "embedding": F.embedding, "linear": F.linear, "addmm": torch.addmm, "getitem": torch.Tensor.__getitem__,
            "bridge": dynamo_bridge.extract_graph_helper, "torch.xla": getattr(torch, "xla", None),
            "optimizer_hooks": (len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks)),
            "where": torch.where, "nonzero": torch.nonzero, "tensor_nonzero": torch.Tensor.nonzero,
            "histc": torch.histc, "tensor_histc": torch.Tensor.histc, "masked_scatter": torch.Tensor.masked_scatter,
            "cat": torch.cat, "tensor_unbind": torch.Tensor.unbind, "tensor_split": torch.Tensor.split}

before = current()
import xla_tp
from xla_tp import compat

def changed():
    return sorted(k for k, v in current().items() if v is not before[k] and v != before[k])

mesh = xla_tp.make_mesh(model=8)
first = xla_tp.parallelize_xla(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)),
                               "auto", mesh=mesh)
second = xla_tp.parallelize_xla(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)),
                                "auto", mesh=mesh)
out = {"while_parallelized": changed()}
xla_tp.unparallelize(first)
out["one_left"] = changed()
second(torch.randn(4, 16).to(torch_xla.device())).sum().backward()
xla_tp.unparallelize(second)
out["none_left"], out["installed"] = changed(), compat.installed()
out["plain"] = [hasattr(p, "_xla_tp") for p in second.parameters()] + [len(m._forward_hooks) + len(m._forward_pre_hooks)
                                                                        for m in second.modules()]
third = xla_tp.parallelize_xla(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)),
                               "auto", mesh=mesh)
out["third"] = changed()
del third
gc.collect()
out["collected"] = changed()
print(json.dumps(out))
'''


def test_torch_functions_are_the_originals_once_no_parallelized_model_remains():
    """While a model is parallelized, xla_tp's few process-wide effects are installed, and torch's functions are
    its own; after ``unparallelize`` of the last
    one (or once it is garbage-collected) every function is torch's own object again, the optimizer
    hooks and ``torch.xla`` are gone, and the model carries nothing of xla_tp."""
    out = json.loads(run_fresh(ORIGINALS, fast_compile=True).strip().splitlines()[-1])
    # torch's functions (F.linear, torch.matmul, SDPA, x[i], embedding, layer_norm, MHA, where, ...) stay torch's
    # own objects: the lowering is a mode around the modules that own a rewrite; what changes is what no module owns
    everything = ["bridge", "cat", "histc", "masked_scatter", "optimizer_hooks", "tensor_histc", "tensor_split",
                  "tensor_unbind", "torch.xla"]
    assert out["while_parallelized"] == everything
    assert out["one_left"] == everything
    assert out["none_left"] == [] and out["installed"] == []
    assert not any(out["plain"])
    assert out["third"] == everything and out["collected"] == []
