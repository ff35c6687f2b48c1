"""Dropless MoE through the grouped route (``lowering/ragged.py``): tokens sorted by expert, grouped matmuls.

On TPU the grouped matmul is torch_xla's Pallas megablox kernel, chosen by default; here the same manual-sharding
region runs its reference (``ReferenceKernel``), or a stand-in for torch_xla's kernel module that records how it is
called. Every family's logits, loss and gradients equal the CPU model's, with the collectives of the slots route
and no all-gather; a new routing compiles nothing.
"""
from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.compiles import compiled
from xla_tp.lowering import ragged
from xla_tp.lowering.packed import as_written

from ..helpers import grads, max_err
from ..hlo_count import collectives_of
from ..moe_models import build

QUICK = ("mixtral", "gpt_oss")  # the complete tier runs every family
CASES = [pytest.param(name, None, id=name, marks=() if name in QUICK else pytest.mark.complete)
         for name in ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "nemotron_h")]
CASES.append(pytest.param("mixtral", "expert-parallel", id="mixtral-expert-parallel"))


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


def step(model, ids):
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out


def program(model, out) -> str:
    """The training step's partitioned program (read before anything runs it)."""
    pending = [p.grad for p in model.parameters() if p.grad is not None]
    return torch_xla._XLAC._get_xla_tensors_hlo([out.logits, out.loss, *pending])


def trained(name: str, mesh, route: str, seed: int = 0, experts=None):
    torch.manual_seed(seed)
    cpu = build(name)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), xla_tp.plan_for(cpu, mesh=mesh, experts=experts), mesh=mesh)
    xla_tp.set_moe_options(model, route=route)
    ids = torch.randint(0, 128, (4, 16))
    return cpu, step(cpu, ids), model, step(model, ids.to(torch_xla.device()))


@pytest.mark.parametrize("name,experts", CASES)
def test_the_grouped_route_trains_like_the_cpu_model_with_the_slots_routes_collectives(name, experts, mesh):
    """Each family as "auto" plans it (expert-tensor-parallel); Mixtral's experts also split whole (expert-parallel:
    each device's groups from its ``group_offset``, the others' rows zero)."""
    cpu, ref, model, out = trained(name, mesh, "grouped", experts=experts)
    grouped = collectives_of(program(model, out))
    assert max_err(out.logits, ref.logits) < 1e-4 and out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-5)
    got = {n: as_written(model.get_parameter(n), g) for n, g in grads(model).items()}
    assert max(max_err(got[n], p.grad) for n, p in cpu.named_parameters() if p.grad is not None) < 1e-4
    for layer in xla_tp.moe_report(model).values():
        assert (layer["route"], layer["cost"], layer["dropped"], layer["dropless"]) == ("grouped", 1.0, 0, True)
    _, _, slots_model, slots_out = trained(name, mesh, "slots", experts=experts)
    slots = collectives_of(program(slots_model, slots_out))
    assert set(grouped) == set(slots) == {"all-reduce"}  # no all-gather, all-to-all or permute, either route
    assert grouped["all-reduce"][0] == slots["all-reduce"][0]


def test_expert_tensor_parallel_and_a_new_routing_compile_nothing_new(mesh):
    """6 experts on 4 devices: every expert's features split; a second batch (another routing) reuses the program."""
    torch.manual_seed(0)
    cpu = build("mixtral", experts=6)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    xla_tp.set_moe_options(model, route="grouped")
    programs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ids = torch.randint(0, 128, (4, 16))
        before = compiled()
        with torch.no_grad():
            logits = model(ids.to(torch_xla.device())).logits
        torch_xla.sync()
        programs.append(compiled() - before)
        assert max_err(logits, cpu(ids).logits) < 1e-4  # (fetching the split logits compiles a program of its own)
    assert programs[1] == 0  # the second routing: no new program
    (layer,) = xla_tp.moe_report(model).values()
    assert (layer["layout"], layer["route"]) == ("expert-tensor-parallel", "grouped")


class RecordingKernel(ragged.ReferenceKernel):
    """The reference, recording every call's arguments as the kernel gets them."""

    def __init__(self):
        self.calls = []

    def gmm(self, lhs, rhs, group_sizes, tiling, group_offset, transpose_rhs):
        self.calls.append(("gmm", tuple(lhs.shape), tuple(rhs.shape), group_sizes.dtype, tuple(group_sizes.shape),
                           tiling, group_offset.dtype, group_offset.dim(), transpose_rhs))
        return super().gmm(lhs, rhs, group_sizes, tiling, group_offset, transpose_rhs)

    def tgmm(self, lhs, rhs, group_sizes, tiling, group_offset, num_actual_groups):
        self.calls.append(("tgmm", tuple(lhs.shape), tuple(rhs.shape), group_sizes.dtype, tuple(group_sizes.shape),
                           tiling, group_offset.dtype, group_offset.dim(), num_actual_groups))
        return super().tgmm(lhs, rhs, group_sizes, tiling, group_offset, num_actual_groups)


@pytest.fixture
def on_a_tpu(monkeypatch):
    """torch_xla's device type reads TPU and its kernel module is a stand-in that records its calls."""
    import torch_xla.runtime as xr
    kernel = RecordingKernel()
    fake = types.ModuleType("torch_xla.experimental.custom_kernel")
    fake.gmm = lambda lhs, rhs, sizes, tiling, group_offset, transpose_rhs: kernel.gmm(
        lhs, rhs, sizes, tiling, group_offset, transpose_rhs)
    fake.tgmm = lambda lhs, rhs, sizes, tiling, group_offset, num_actual_groups: kernel.tgmm(
        lhs, rhs, sizes, tiling, group_offset, num_actual_groups)
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    monkeypatch.setitem(sys.modules, "torch_xla.experimental.custom_kernel", fake)
    monkeypatch.setattr(torch_xla.experimental, "custom_kernel", fake, raising=False)
    ragged.device_kernel.cache_clear()
    yield kernel
    ragged.device_kernel.cache_clear()


def test_on_a_tpu_the_default_route_calls_the_pallas_kernel_as_its_contract_says(mesh, on_a_tpu):
    assert isinstance(ragged.device_kernel(), ragged.PallasKernel)
    cpu, ref, model, out = trained("mixtral", mesh, "auto")  # default options
    assert max_err(out.logits, ref.logits) < 1e-4
    got = {n: as_written(model.get_parameter(n), g) for n, g in grads(model).items()}
    assert max(max_err(got[n], p.grad) for n, p in cpu.named_parameters() if p.grad is not None) < 1e-4
    assert [layer["route"] for layer in xla_tp.moe_report(model).values()] == ["grouped"]
    # per device: all 8 experts, a quarter of their features (expert-tensor-parallel over model=4); the rows of
    # 32 tokens x top-2, padded to the row tile
    kinds = [c[0] for c in on_a_tpu.calls]
    assert kinds.count("gmm") == 2 + 2 + 2 and kinds.count("tgmm") == 2  # forward; recomputed; rows' grads; experts'
    for kind, lhs, rhs, sizes_dtype, sizes_shape, tiling, offset_dtype, offset_dim, last in on_a_tpu.calls:
        assert sizes_dtype == torch.int32 and sizes_shape == (8,) and offset_dtype == torch.int32 and offset_dim == 0
        rows = lhs[0] if kind == "gmm" else lhs[1]
        assert rows % tiling[0] == 0 and rows >= 32 * 2
        if kind == "gmm":
            assert rhs[0] == 8 and rhs[2 if last else 1] == lhs[1]  # [experts, out, in] transposed, else [.., in, out]
        else:
            assert last == 8


def test_without_the_kernel_off_tpu_the_default_route_is_slots(mesh):
    ragged.device_kernel.cache_clear()
    assert ragged.device_kernel() is None
    _, ref, model, out = trained("olmoe", mesh, "auto")
    assert [layer["route"] for layer in xla_tp.moe_report(model).values()] == ["slots"]
    assert max_err(out.logits, ref.logits) < 1e-4


def test_options_that_contradict_each_other_are_refused_and_change_nothing(mesh):
    model = xla_tp.parallelize_xla(build("mixtral"), "auto", mesh=mesh)
    before = vars(xla_tp.set_moe_options(model)).copy()
    with pytest.raises(ValueError, match="route='grouped' is dropless by design"):
        xla_tp.set_moe_options(model, capacity_factor=1.25, route="grouped")
    with pytest.raises(ValueError, match="route='sorted': pass one of auto, grouped, slots"):
        xla_tp.set_moe_options(model, route="sorted")
    assert vars(xla_tp.set_moe_options(model)) == before == {"capacity_factor": 1.25, "dropless": True, "route": "auto"}


def test_a_call_that_breaks_the_kernels_contract_says_what():
    kernel = ragged.ReferenceKernel()
    lhs, rhs = torch.ones(6, 4), torch.ones(2, 4, 3)
    with pytest.raises(ValueError, match=r"rows a multiple of the row tile 4.*group_sizes must be 1-D int32"):
        kernel.gmm(lhs, rhs, torch.tensor([3, 3]), (4, 4, 4), torch.tensor(0, dtype=torch.int32), False)


def test_the_benchs_costs_the_grouped_route_within_15_percent_of_the_routed_flops():
    """Mixtral-8x7B's and DeepSeek-V3's layers at 4,096 tokens per data shard, a skewed routing (bench.moe's costs
    table): the kernel's row tiles stay within 15% of the routed rows under expert-tensor-parallel; slots cost
    what they allocate (dropless: E / k), capacity 1.25 drops what the skew sends past it."""
    from bench.moe import route_costs
    for name, (experts, top_k) in (("mixtral-8x7b", (8, 2)), ("deepseek-v3", (256, 8))):
        rows = {(r["route"], r["layout"]): r for r in route_costs(name)}
        assert rows["dropless (grouped)", "expert-tensor-parallel"]["over_routed"] <= 1.15
        assert rows["dropless (slots)", "expert-parallel"]["over_routed"] == experts / top_k
        assert rows["capacity 1.25 (slots)", "expert-parallel"]["dropped"] > 0
        assert all(r["dropped"] == 0 for key, r in rows.items() if key[0].startswith("dropless"))
        # expert-parallel: the busiest device's experts (the router's skew), not the even share
        assert 1.15 < rows["dropless (grouped)", "expert-parallel"]["over_routed"] < experts / top_k
