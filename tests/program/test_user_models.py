"""Models and plans written by users, not by us: CUDA-style code under torch's sequence-parallel plan
applied through several ``parallelize_module`` calls; plans on dimensions the axis does not divide."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import transformers
from torch.distributed.device_mesh import DeviceMesh

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.auditing.hlo import collective_summary, parse_collectives
from xla_tp.zoo.cuda_llama import CudaLlama, sp_plan_calls
from xla_tp.zoo.llama import LlamaArgs

from ..helpers import Tied, grads, max_err

LAYERS = 2


def test_cuda_style_llama_under_torch_sp_plan_in_several_calls_is_at_the_sp_minimum():
    """SDPA, view(b, s, -1, head_dim) and complex rotary, plan applied root first then per block: the
    compiled forward has SP's minimum (per layer 2 all-gathers and 2 reduce-scatters, plus the
    embedding's reduce-scatter and the final all-gather), attention runs split (balance 1.00) and
    values and gradients match the CPU."""
    xla_tp.make_mesh(model=8)
    mesh = DeviceMesh("xla", list(range(8)))
    torch.manual_seed(0)
    ref = CudaLlama(LlamaArgs(dim=64, n_heads=8, n_layers=LAYERS))
    model = copy.deepcopy(ref)
    for module, plan in sp_plan_calls(model):
        xla_tp.parallelize_module(module, mesh, plan)
    tokens = torch.randint(0, 128, (4, 16))
    logits = model(tokens.to(torch_xla.device()))
    text = capture_partitioned_hlo([logits])
    counts = {k: v["count"] for k, v in collective_summary(parse_collectives(text)).items()}
    # on CPU GSPMD writes each reduce-scatter as all-reduce + dynamic-slice
    assert counts == {"all-gather": 2 * LAYERS + 1, "all-reduce": 2 * LAYERS + 1}, counts
    report = xla_tp.audit(model, tokens.to(torch_xla.device()), mesh=mesh)  # the layouts of every call
    assert report.comm_ratio == pytest.approx(1.0) and report.compute_balance == pytest.approx(1.0), report

    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten().to(logits.device))
    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    ref_loss.backward()
    assert max_err(loss, ref_loss) < 1e-5
    got = grads(model)
    for n, p in ref.named_parameters():
        assert max_err(got[n], p.grad) < 1e-5, n


def test_a_torch_plan_on_an_uneven_dimension_shards_like_torch_with_one_warning():
    torch.manual_seed(0)
    ref = Tied(vocab=1001, dim=16)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xla_tp.parallelize_xla(model, {"emb": RowwiseParallel(), "head": ColwiseParallel(output_layouts=None)},
                               mesh=xla_tp.make_mesh(model=8))
    padding = [str(w.message) for w in caught if "pads" in str(w.message)]
    assert len(padding) == 1 and "emb.weight dim 0 (1001 -> 1008 over 8)" in padding[0]
    ids = torch.randint(0, 1001, (2, 8))
    out = model(ids.to(torch_xla.device()))
    assert max_err(out, ref(ids)) < 1e-5


def test_gpt2_with_its_real_vocabulary_splits_the_vocabulary():
    """50257 does not divide 8: "auto" still splits the tied embedding/head (XLA pads 7 rows)."""
    mesh = xla_tp.make_mesh(model=8)
    cfg = transformers.GPT2Config(n_embd=128, n_layer=LAYERS, n_head=8, vocab_size=50257, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with pytest.warns(UserWarning, match=r"transformer.wte.weight dim 0 \(50257 -> 50264 over 8\)"):
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    ids = torch.randint(0, 50257, (2, 16)).to(torch_xla.device())
    report = xla_tp.audit(model, ids, mesh=mesh)
    assert report.compute_balance <= 1.10, report
    assert report.param_bytes_per_device <= 0.20 * report.param_bytes_total, report
