"""``xla_tp.audit`` from a plain script (no XLA_DUMP_POST_OPTIMIZATIONS): the path users walk.

Each script runs in a fresh Python whose environment holds only PJRT_DEVICE and CPU_NUM_DEVICES. The
first one reads torch_xla's program itself before auditing (as a user debugging does), which fixes
the process to unpartitioned HLO, so its audits compile through jaxlib. Its reports must equal the
in-process audit of this session (conftest sets the variable: torch_xla's own compiler) field for
field: HF Llama "auto" forward,
and the torch model parallelized in several calls, forward+backward. GPT-2 "auto" is audited
forward+backward there and must leave every parameter as it was.
"""
import json

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.zoo import registry

from ..fresh import run_fresh

AUDITS = '''
import json, os, sys, torch, torch_xla, xla_tp
from xla_tp.zoo import registry
from tests.titan import report_dict, settled, titan

assert "XLA_DUMP_POST_OPTIMIZATIONS" not in os.environ
out = {}
mesh = xla_tp.make_mesh(data=2, model=4)
torch_xla._XLAC._get_xla_tensors_hlo([torch.ones(2, device=torch_xla.device()) * 2])  # torch_xla's own text first
for name, backward in (("llama", False), ("gpt2", True)):
    torch.manual_seed(0)
    model = xla_tp.parallelize_xla(registry.build(name), "auto", mesh=mesh)
    before = {n: (settled(p), p.detach().cpu().clone()) for n, p in model.named_parameters()}
    report = xla_tp.audit(model, registry.example_input(name).to(torch_xla.device()), mesh=mesh, backward=backward)
    out[name] = {**report.to_dict(), "notes": None}
    out[name + " notes"] = report.notes
    # every annotation (none on the norms), value and gradient as the audit found it
    out[name + " unchanged"] = all(settled(p) == before[n][0] and torch.equal(p.detach().cpu(), before[n][1])
                                   and p.grad is None for n, p in model.named_parameters())
    out[name + " bare"] = sum(1 for s, _ in before.values() if s == "")

# a torch model parallelized in several calls (root, then each block), forward+backward
model, mesh = titan("root_first")
out["titan"] = report_dict(model, mesh)

# a forward that fails raises the model's own error
bad = torch.randint(0, 128, (4, 80)).to(torch_xla.device())  # longer than max_seq_len 64
errors = []
for call in (lambda: model(bad), lambda: xla_tp.audit(model, bad, mesh=mesh)):
    try:
        call()
    except Exception as error:
        errors.append([type(error).__name__, str(error)])
out["errors"] = errors

# without jaxlib: a clear error saying what to do
sys.modules["jaxlib"] = None
try:
    xla_tp.audit(model, torch.randint(0, 128, (4, 16)).to(torch_xla.device()), mesh=mesh)
except RuntimeError as error:
    out["no_jaxlib"] = str(error)
print("JSON" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def fresh_audits() -> dict:
    out = run_fresh(AUDITS)
    return json.loads(next(line[4:] for line in out.splitlines() if line.startswith("JSON")))


def _routed(fresh: dict) -> dict:
    """A plain script's audit (jaxlib's route) without the peak memory that only that route reports."""
    assert fresh["temp_bytes_per_device"] > 0  # XLA's buffer assignment, read from jaxlib's compile
    return {**fresh, "temp_bytes_per_device": None}


def test_hf_auto_audit_from_a_plain_script_equals_the_in_process_audit(fresh_audits):
    mesh = xla_tp.make_mesh(data=2, model=4)
    torch.manual_seed(0)
    model = xla_tp.parallelize_xla(registry.build("llama"), "auto", mesh=mesh)
    here = xla_tp.audit(model, registry.example_input("llama").to(torch_xla.device()), mesh=mesh)
    assert _routed(fresh_audits["llama"]) == {**here.to_dict(), "notes": None}
    assert here.comm_ratio == 1.0 and here.compute_balance == 1.0
    assert any("jaxlib" in note for note in fresh_audits["llama notes"])


def test_gpt2_auto_backward_audit_from_a_plain_script_leaves_the_model_alone(fresh_audits):
    gpt2 = fresh_audits["gpt2"]
    assert gpt2["backward"] and gpt2["compute_balance"] == 1.0 and gpt2["collectives"]["all-reduce"]["count"] > 0
    assert fresh_audits["gpt2 bare"] > 0  # the layer norms carry no annotation, before and after
    assert fresh_audits["gpt2 unchanged"] and fresh_audits["llama unchanged"]


def test_torch_model_in_several_calls_audits_from_a_plain_script(fresh_audits, titan_single_call):
    assert _routed(fresh_audits["titan"]) == titan_single_call[2]


def test_plain_script_audit_surfaces_the_models_error_and_explains_a_missing_jaxlib(fresh_audits):
    direct, audited = fresh_audits["errors"]
    assert audited == direct and "max_seq_len" in direct[1]
    assert "pip install 'xla_tp[jax]'" in fresh_audits["no_jaxlib"]
    assert "XLA_DUMP_POST_OPTIMIZATIONS=1" in fresh_audits["no_jaxlib"]


LLAMA_8B_LAYER = '''
import json, threading, time, torch, torch_xla, transformers, xla_tp


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


mesh = xla_tp.make_mesh(model=8)
config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, num_hidden_layers=1)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
# the audit reads shapes, dtypes and shardings: uninitialised CPU weights (no init cost) do
model = xla_tp.parallelize_xla(model.to_empty(device="cpu"), "hf", mesh=mesh)
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
ids = torch.randint(0, 128256, (1, 128)).to(torch_xla.device())
base, peak, done = rss(), [0], threading.Event()


def sample() -> None:
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)


sampler = threading.Thread(target=sample)
sampler.start()
start = time.time()
report = xla_tp.audit(model, ids, mesh=mesh)
seconds = time.time() - start
done.set()
sampler.join()
print("JSON" + json.dumps({"model_bytes": model_bytes, "rss_before": base, "rss_peak": max(peak[0], rss()),
                           "seconds": seconds, "comm_ratio": report.comm_ratio,
                           "compute_balance": report.compute_balance}))
'''


@pytest.mark.complete
def test_llama_8b_shaped_layer_audits_with_a_small_fraction_of_its_size(capsys):
    """1 layer of Llama-3-8B (bf16, 2.4 GB of weights), plan "hf": the audit adds little memory."""
    out = run_fresh(LLAMA_8B_LAYER)
    facts = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("JSON")))
    added = facts["rss_peak"] - facts["rss_before"]
    with capsys.disabled():
        print(f"\n8B-shaped layer: weights {facts['model_bytes'] / 2**30:.2f} GiB, process RSS before the audit "
              f"{facts['rss_before'] / 2**30:.2f} GiB, peak during it {facts['rss_peak'] / 2**30:.2f} GiB "
              f"(+{added / 2**20:.0f} MiB), audit {facts['seconds']:.1f} s")
    assert facts["model_bytes"] > 2 * 2**30
    assert added < 0.1 * facts["model_bytes"], facts
    assert facts["comm_ratio"] == 1.0 and facts["compute_balance"] == 1.0
