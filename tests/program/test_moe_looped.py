"""MoE layers that loop over per-expert modules (a ``ModuleList``) and pick each expert's tokens with
``torch.where``: planned by "auto" with no example input, run at static positions (one program
whatever the routing), equal to the CPU model when dropless, drops counted otherwise."""
import copy
import math
import re

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

import xla_tp
from xla_tp.auditing.params import local_numel, sharding_string

from ..helpers import max_err
from ..looped_moe import (EXPERTS, HIDDEN, INTER, TOP_K, AddAssignMoe, Decoder, EqualsMoe, HitEqualsMoe, HitLoopMoe,
                         OneHotMoe, batch)


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


@pytest.mark.parametrize("moe", [OneHotMoe, EqualsMoe, AddAssignMoe, HitLoopMoe, HitEqualsMoe])
def test_auto_plans_the_experts_and_trains_like_the_cpu_model_in_one_program(mesh, moe):
    torch.manual_seed(0)
    cpu = Decoder(moe)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)  # no example input, default options
    specs = {n: sharding_string(p) for n, p in model.named_parameters()}
    for name in ("moes.0.experts.3.w1.weight", "moes.1.experts.7.w2.weight"):  # split 4 ways, each expert
        assert local_numel((INTER, HIDDEN), specs[name]) * 4 == INTER * HIDDEN, specs
    assert specs["moes.0.gate.weight"] in ("", "{replicated}"), specs  # the router computes its choice whole
    compiles = []
    for step in range(3):
        ids = batch(step)
        met.clear_all()
        out, ref = model(ids.to(torch_xla.device())), cpu(ids)
        out.square().mean().backward()
        ref.square().mean().backward()
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)
        assert max_err(out, ref) < 1e-4
        assert {n: (r["routed"], r["dropped"]) for n, r in xla_tp.moe_report(model).items()} == {
            f"moes.{i}": (64 * TOP_K, 0) for i in range(2)}
    assert compiles[2] == 0, compiles  # another routing, the same program
    grads = dict(cpu.named_parameters())
    assert max(max_err(p.grad, grads[n].grad) for n, p in model.named_parameters()) < 1e-4
    for p in model.parameters():
        p.grad = None
    cpu.zero_grad()


def test_capacity_drops_what_does_not_fit_and_counts_it(mesh):
    torch.manual_seed(0)
    cpu = Decoder(OneHotMoe, layers=1)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    xla_tp.set_moe_options(model, capacity_factor=1.0)
    ids = batch(7)
    out = model(ids.to(torch_xla.device()))
    torch_xla.sync()
    hidden = cpu.norms[0](cpu.embed(ids)).flatten(0, 1)
    chosen = torch.topk(cpu.moes[0].gate(hidden), TOP_K).indices.view(2, -1)  # one group per data shard
    capacity = math.ceil(chosen.shape[1] / EXPERTS)  # per group, capacity factor 1
    want = sum(int((torch.bincount(c, minlength=EXPERTS) - capacity).clamp(min=0).sum()) for c in chosen)
    report = xla_tp.moe_report(model)["moes.0"]
    assert want > 0 and (report["routed"], report["dropped"]) == (chosen.numel(), want), (report, want)
    assert max_err(out, cpu(ids)) > 1e-3  # dropped tokens skip their experts


class _Flipped(OneHotMoe):
    def forward(self, hidden):
        x = hidden.flatten(0, 1)
        weights, ids = torch.topk(self.gate(x).softmax(-1), TOP_K)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = torch.where(ids == e)
            token, choice = token.flip(0), choice.flip(0)  # a reader the static positions do not serve
            out = out.index_add(0, token, expert(x[token]) * weights[token, choice, None])
        return out.view_as(hidden)


class _Reversed(HitEqualsMoe):
    def chosen(self, hit):
        return hit.flip(0)  # a reader every expert does not serve


@pytest.mark.parametrize("moe, says", [
    (_Flipped, r"moes.0 picks tokens with torch.where and reads the positions with 'flip'"),
    (_Reversed, r"moes.0 loops over the experts of a 1-D nonzero\(\) and reads them with 'flip'")])
def test_positions_read_other_than_as_an_index_leave_the_layer_data_dependent(mesh, moe, says):
    torch.manual_seed(0)
    cpu = Decoder(moe, layers=1)
    with pytest.warns(UserWarning, match=says):
        model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    assert xla_tp.moe_report(model) == {}
    ids = batch(3)
    assert max_err(model(ids.to(torch_xla.device())), cpu(ids)) < 1e-4


@pytest.mark.parametrize("moe", [OneHotMoe, AddAssignMoe])
def test_tokens_stay_on_their_data_shard_one_all_reduce_per_expert(mesh, moe):
    """Positions are chosen within each batch shard and read (and written) there: no gather over the data axis."""
    torch.manual_seed(0)
    model = xla_tp.parallelize_xla(Decoder(moe, layers=1), "auto", mesh=mesh)
    report = xla_tp.audit(model, batch(0).to(torch_xla.device()), mesh=mesh)
    assert report.count("all-gather") == 0 and report.count("collective-permute") == 0, report
    assert report.count("all-reduce") == EXPERTS + 1 and report.comm_ratio == pytest.approx(1.0), report


class _Scaled(Decoder):
    def forward(self, ids, scale):  # a second input "auto" cannot make up: planned at the first call
        return super().forward(ids) * scale


def test_options_set_before_a_deferred_plan_are_kept_for_it(mesh):
    torch.manual_seed(0)
    cpu = _Scaled(OneHotMoe, layers=1)
    with pytest.warns(UserWarning, match="planned and parallelized at its first call"):
        model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    assert not xla_tp.set_moe_options(model, capacity_factor=1.0).dropless
    assert xla_tp.set_moe_options(model, dropless=True).dropless
    ids, scale = batch(5), torch.rand(4, 16, 1)
    out = model(ids.to(torch_xla.device()), scale.to(torch_xla.device()))
    assert max_err(out, cpu(ids, scale)) < 1e-4
    assert xla_tp.moe_report(model)["moes.0"]["dropless"] and xla_tp.moe_report(model)["moes.0"]["dropped"] == 0


def test_under_torch_compile_the_selecting_modules_run_between_graphs(mesh):
    """dynamo traces no tensor subclass of the static positions' kind: each selecting module is a graph break."""
    torch.manual_seed(0)
    cpu = Decoder(EqualsMoe, layers=1)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    compiled = torch.compile(model, backend="openxla")
    for seed in (1, 2):
        ids = batch(seed)
        assert max_err(compiled(ids.to(torch_xla.device())), cpu(ids)) < 1e-4


def test_hf_dbrx_loops_over_the_chosen_experts_of_its_fused_weights_like_the_cpu_model(mesh):
    """transformers' DBRX (no test was written for it): ``for e in expert_hit`` over its one-hot of experts + 1
    classes, each expert's rows of the fused ``[experts x inter, hidden]`` weights taken by the index's value.
    Every position is looped over at a static size (the extra one reads the last expert's rows, clamped, and
    picks no token); the fused weights stay whole (a view indexed per expert: no rule splits it), said by explain.
    SGD steps on three routings: the CPU model's logits and parameters (state_dict: the packed q/k/v in its
    own order), one program."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.DbrxConfig(d_model=64, n_heads=8, n_layers=1, max_seq_len=64, vocab_size=128,
                                  attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                  ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2})
    cpu = transformers.DbrxForCausalLM(cfg)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, cpu)]
    compiles = []
    for seed in (1, 2, 3):
        ids = batch(seed)
        met.clear_all()
        out, ref = model(ids.to(torch_xla.device())).logits, cpu(ids).logits
        for loss, opt in zip((out, ref), opts):
            loss.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)
        assert max_err(out, ref) < 1e-4
        assert xla_tp.moe_report(model)["transformer.blocks.0.ffn.experts"]["routed"] == ids.numel() * 2
        want = cpu.state_dict()
        assert max(max_err(p, want[n]) for n, p in model.state_dict().items()) < 1e-5
    assert compiles[2] == 0, compiles  # after the warm-up, another routing: the same program
    explained = xla_tp.plan_for(cpu, mesh=mesh).explain(cpu, mesh)
    assert re.search(r"ffn\.experts\.mlp\.w1 +used by 'view' in transformer\.blocks\.\*\.ffn\.experts: no rule splits it",
                     explained), explained


def test_hf_longcat_flash_with_identity_experts_gives_the_cpu_models_logits(mesh):
    """LongCat-Flash (no test was written for it): ``int(e.item())`` per chosen expert, identity ("zero") experts
    past the routed ones, fused ``gate_up_proj[e]``: a static site, every token routed."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LongcatFlashConfig(vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
                                          ffn_hidden_size=128, expert_ffn_hidden_size=32, n_routed_experts=8,
                                          zero_expert_num=2, moe_topk=2, kv_lora_rank=16, q_lora_rank=24,
                                          qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    cpu = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    ids = batch(4)
    assert max_err(model(ids.to(torch_xla.device())).logits, cpu(ids).logits) < 1e-4
    report = xla_tp.moe_report(model)["model.layers.0.mlp.experts"]
    assert (report["routed"], report["dropped"]) == (ids.numel() * 2, 0), report


def test_loop_positions_are_host_integers_that_mix_with_device_tensors():
    """``for e in hit.nonzero():`` then ``ids == e`` (a [1] tensor on the host against the device's ids), ``e == ids``,
    ``x[e]`` and ``x[e[0]]``: what the CPU computes, on the XLA device; an index past the dimension reads its last entry."""
    from xla_tp.dataflow.positions import every_position
    ids = torch.tensor([[0, 3], [2, 3]])
    x = torch.arange(12.0).view(4, 3)
    xids, xx = ids.to(torch_xla.device()), x.to(torch_xla.device())
    for e in every_position(5):
        n, i = int(e[0]), min(int(e[0]), 3)
        assert torch.equal((xids == e).cpu(), ids == n) and torch.equal((e == xids).cpu(), ids == n)
        assert torch.equal(xx[e].cpu(), x[[i]]) and torch.equal(xx[e[0]].cpu(), x[i])


def test_a_collected_model_leaves_no_site_behind(mesh):
    """The sites are kept by module, weakly: a model dropped without ``unparallelize`` takes its sites along
    (a new module that reuses the id finds none)."""
    import gc

    from xla_tp.lowering import selection
    gc.collect()  # the earlier tests' models, left to the collector, not counted
    before = len(selection._installed)
    model = xla_tp.parallelize_xla(Decoder(EqualsMoe, layers=1), "auto", mesh=mesh)
    module = model.moes[0]
    assert selection.site_of(module) is not None and len(selection._installed) == before + 1
    del model, module
    gc.collect()
    assert len(selection._installed) == before
