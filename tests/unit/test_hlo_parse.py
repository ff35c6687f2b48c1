"""Tests of the compiled-HLO reader (xla_tp.auditing.hlo) on real and hand-written HLO text.

The fixtures in tests/data/hlo/ are real per-device HLO from torch_xla 2.9 on CPU
(PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 XLA_DUMP_POST_OPTIMIZATIONS=1, use_spmd(), one warm-up
computation), captured with ``torch_xla._XLAC._get_xla_tensors_hlo``. Mesh for all of them:
``xs.Mesh(np.arange(8), (2, 4), ("data", "model"))`` unless the name says otherwise. Programs:

- mlp_fwd_2x4: x[8,16] ("data", None); w1[32,16] ("model", None); w2[16,32] (None, "model");
  y = linear(relu(linear(x, w1)), w2). Megatron colwise -> rowwise.
- mlp_fwd_2x4_permuted_mesh: the same on ``xs.Mesh([0,2,4,6,1,3,5,7], (2, 4), ...)``.
- mlp_fwd_output_sharded_2x4: the same, output constrained to ("model", None).
- mlp_bwd_bf16_2x4: the same in bf16 (made on CPU, then moved), HLO of (w1.grad, w2.grad)
  after ``y.float().sum().backward()``.
- reshard_dim0_to_dim1_2x4: d[16,16] ("model", None); e = d + 1 constrained to (None, "model").
- conv1d_halo_2x4: conv1d(a[2,4,32] (None, None, "model"), w[4,4,3], padding=1), output sharded
  the same way.
- einsum_heads_2x4: einsum("bhqd,bhkd->bhqk") of two [2,4,8,16] tensors sharded on dim 1.
"""
import doctest
from pathlib import Path

import numpy as np
import pytest

from xla_tp.auditing import hlo
from xla_tp.auditing.hlo import (Collective, collective_summary, dot_flops, mesh_axes_of_groups,
                              parse_collectives)

DATA = Path(__file__).resolve().parents[1] / "data" / "hlo"
MESH_2X4 = np.arange(8).reshape(2, 4)
AXES = ("data", "model")


def fixture(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def axes_of(collective: Collective, ids: np.ndarray = MESH_2X4) -> tuple[str, ...]:
    return mesh_axes_of_groups(collective.replica_groups, ids, AXES)


# Hand-written, in the style of TPU post-optimisation HLO (async pairs, tiled layouts, iota groups,
# matmuls inside fusions, a while loop). Mesh (2, 4) ("data", "model") over devices 0..7.
TPU_STYLE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[64,1024]{1,0:T(8,128)(2,1)})->bf16[64,1024]{1,0:T(8,128)(2,1)}}

%add.1 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.2 = f32[] add(f32[] %x, f32[] %y)
}

%fused_matmul (param_0: bf16[256,1024], param_1: bf16[1024,128]) -> f32[256,128] {
  %param_0 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %dot.7 = f32[256,128]{1,0:T(8,128)} dot(bf16[256,1024]{1,0:T(8,128)(2,1)} %param_0, bf16[1024,128]{1,0:T(8,128)(2,1)} %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_conv (param_0.1: f32[256,128], param_1.1: bf16[128,1024]) -> f32[256,1024] {
  %param_0.1 = f32[256,128]{1,0:T(8,128)} parameter(0)
  %param_1.1 = bf16[128,1024]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.3 = f32[256,1024]{1,0:T(8,128)} convolution(f32[256,128]{1,0:T(8,128)} %param_0.1, bf16[128,1024]{1,0:T(8,128)(2,1)} %param_1.1), dim_labels=bf_io->bf
}

%body (loop: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %loop = (s32[], f32[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8,128]{1,0}) %loop), index=0
  %v = f32[8,128]{1,0} get-tuple-element((s32[], f32[8,128]{1,0}) %loop), index=1
  %collective-permute-start = (f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) collective-permute-start(f32[8,128]{1,0} %v), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %collective-permute-done = f32[8,128]{1,0} collective-permute-done((f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) %collective-permute-start)
  ROOT %t = (s32[], f32[8,128]{1,0}) tuple(s32[] %i, f32[8,128]{1,0} %collective-permute-done)
}

%cond (loop.1: (s32[], f32[8,128])) -> pred[] {
  %loop.1 = (s32[], f32[8,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element((s32[], f32[8,128]{1,0}) %loop.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(s32[] %i.1, s32[] %n), direction=LT
}

ENTRY %main.42_spmd (p0: bf16[64,1024], p1: bf16[1024,128], p2: bf16[128,1024], p3: (s32[], f32[8,128]), p4: bf16[2,2]) -> bf16[64,1024] {
  %p0 = bf16[64,1024]{1,0:T(8,128)(2,1)} parameter(0), sharding={devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}
  %p1 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(1)
  %p2 = bf16[128,1024]{1,0:T(8,128)(2,1)} parameter(2)
  %p3 = (s32[], f32[8,128]{1,0}) parameter(3)
  %p4 = bf16[2,2]{1,0} parameter(4)
  %all-gather-start = (bf16[64,1024]{1,0:T(8,128)(2,1)}, bf16[256,1024]{1,0:T(8,128)(2,1)}) all-gather-start(bf16[64,1024]{1,0:T(8,128)(2,1)} %p0), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[256,1024]{1,0:T(8,128)(2,1)} all-gather-done((bf16[64,1024]{1,0:T(8,128)(2,1)}, bf16[256,1024]{1,0:T(8,128)(2,1)}) %all-gather-start)
  %fusion.1 = f32[256,128]{1,0:T(8,128)} fusion(bf16[256,1024]{1,0:T(8,128)(2,1)} %all-gather-done, bf16[1024,128]{1,0:T(8,128)(2,1)} %p1), kind=kOutput, calls=%fused_matmul
  %fusion.2 = f32[256,1024]{1,0:T(8,128)} fusion(f32[256,128]{1,0:T(8,128)} %fusion.1, bf16[128,1024]{1,0:T(8,128)(2,1)} %p2), kind=kOutput, calls=%fused_conv
  %all-reduce-start = f32[256,1024]{1,0:T(8,128)} all-reduce-start(f32[256,1024]{1,0:T(8,128)} %fusion.2), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add.1
  %all-reduce-done = f32[256,1024]{1,0:T(8,128)} all-reduce-done(f32[256,1024]{1,0:T(8,128)} %all-reduce-start)
  %reduce-scatter = f32[64,1024]{1,0:T(8,128)} reduce-scatter(f32[256,1024]{1,0:T(8,128)} %all-reduce-done), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add.1
  %all-reduce.9 = (f32[64,1024]{1,0:T(8,128)}, bf16[2,2]{1,0}) all-reduce(f32[64,1024]{1,0:T(8,128)} %reduce-scatter, bf16[2,2]{1,0} %p4), channel_id=4, replica_groups={}, use_global_device_ids=true, to_apply=%add.1
  %while = (s32[], f32[8,128]{1,0}) while((s32[], f32[8,128]{1,0}) %p3), condition=%cond, body=%body
  %gte = f32[64,1024]{1,0:T(8,128)} get-tuple-element((f32[64,1024]{1,0:T(8,128)}, bf16[2,2]{1,0}) %all-reduce.9), index=0
  ROOT %convert = bf16[64,1024]{1,0:T(8,128)(2,1)} convert(f32[64,1024]{1,0:T(8,128)} %gte)
}
"""


def test_docstring_examples_hold():
    assert doctest.testmod(hlo).failed == 0


# --- real CPU HLO -------------------------------------------------------------------------------

def test_megatron_mlp_forward_is_one_all_reduce_over_model():
    collectives = parse_collectives(fixture("mlp_fwd_2x4"))
    assert len(collectives) == 1
    (ar,) = collectives
    # output [8,16] f32, rows split over data (2): per device [4,16] = 256 bytes.
    assert (ar.kind, ar.shape, ar.dtype, ar.bytes) == ("all-reduce", (4, 16), "f32", 256)
    assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert axes_of(ar) == ("model",)
    assert collective_summary(collectives) == {"all-reduce": {"count": 1, "bytes": 256}}


def test_megatron_mlp_forward_flops_are_balanced():
    # per device: x [4,16] @ w1.T [16,8] and h [4,8] @ w2.T [8,16]: 2*4*8*16 each.
    per_device = dot_flops(fixture("mlp_fwd_2x4"))
    assert per_device == 2 * (2 * 4 * 8 * 16)
    assert per_device * 8 == 2 * (2 * 8 * 16 * 32)  # compute balance 1.0: no replicated work


def test_permuted_mesh_groups_follow_device_ids():
    ids = np.array([0, 2, 4, 6, 1, 3, 5, 7]).reshape(2, 4)
    (ar,) = parse_collectives(fixture("mlp_fwd_2x4_permuted_mesh"))
    assert ar.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert axes_of(ar, ids) == ("model",)
    assert axes_of(ar, MESH_2X4) == ("data", "model")  # same groups, wrong mesh: not one axis


def test_output_sharded_on_model_is_all_reduce_plus_slice_on_cpu():
    text = fixture("mlp_fwd_output_sharded_2x4")
    collectives = parse_collectives(text)
    assert [(c.kind, axes_of(c)) for c in collectives] == [
        ("all-gather", ("data",)),  # rows were split over data; the output wants them whole
        ("all-reduce", ("model",)),  # CPU form of reduce-scatter: all-reduce, then dynamic-slice
    ]
    assert [c.bytes for c in collectives] == [8 * 8 * 4, 8 * 16 * 4]
    assert "dynamic-slice" in text


def test_backward_grads_reduce_over_data_in_f32_on_cpu():
    collectives = parse_collectives(fixture("mlp_bwd_bf16_2x4"))
    assert sorted(c.shape for c in collectives) == [(8, 16), (16, 8)]  # dw1, dw2 shards
    assert {axes_of(c) for c in collectives} == {("data",)}
    # the CPU backend promotes bf16 dots and reductions to f32: TPU would move half the bytes
    assert {c.dtype for c in collectives} == {"f32"}
    assert collective_summary(collectives) == {"all-reduce": {"count": 2, "bytes": 2 * 8 * 16 * 4}}
    assert dot_flops(fixture("mlp_bwd_bf16_2x4")) == 4 * (2 * 4 * 8 * 16)


def test_reshard_between_dims_is_one_tuple_all_to_all():
    (a2a,) = parse_collectives(fixture("reshard_dim0_to_dim1_2x4"))
    assert a2a.kind == "all-to-all"
    assert a2a.shape == (4, 1, 4) and a2a.bytes == 4 * (4 * 1 * 4 * 4)  # 4 tuple elements summed
    assert axes_of(a2a) == ("model",)
    assert dot_flops(fixture("reshard_dim0_to_dim1_2x4")) == 0


def test_conv_halo_is_two_collective_permutes_and_conv_flops():
    text = fixture("conv1d_halo_2x4")
    permutes = parse_collectives(text)
    assert [c.kind for c in permutes] == ["collective-permute"] * 2
    assert permutes[0].replica_groups[:2] == ((0, 1), (4, 5))  # source_target_pairs
    assert {axes_of(c) for c in permutes} == {("model",)}
    assert sum(c.bytes for c in permutes) == 2 * (2 * 4 * 1 * 1 * 4)
    # out [2,8] positions x 4 channels per device, 3 taps x 4 input channels each
    assert dot_flops(text) == 2 * (2 * 8 * 4) * (3 * 4)


def test_batched_dot_flops_count_batch_dims_once():
    # per device [2,1,8,16] x [2,1,8,16] -> [2,1,8,8]; replicated over data, so 2x the global work
    per_device = dot_flops(fixture("einsum_heads_2x4"))
    assert per_device == 2 * (2 * 8 * 8) * 16
    assert per_device * 8 == 2 * (2 * 2 * 4 * 8 * 8 * 16)
    assert parse_collectives(fixture("einsum_heads_2x4")) == []


# --- hand-written TPU-style HLO ---------------------------------------------------------------

def test_async_pairs_count_once_with_the_done_shape():
    kinds = [(c.kind, c.name) for c in parse_collectives(TPU_STYLE)]
    assert kinds == [
        ("collective-permute", "collective-permute-start"),
        ("all-gather", "all-gather-start"),
        ("all-reduce", "all-reduce-start"),
        ("reduce-scatter", "reduce-scatter"),
        ("all-reduce", "all-reduce.9"),
    ]
    by_name = {c.name: c for c in parse_collectives(TPU_STYLE)}
    gather = by_name["all-gather-start"]
    assert (gather.shape, gather.dtype, gather.bytes) == ((256, 1024), "bf16", 256 * 1024 * 2)
    assert by_name["collective-permute-start"].bytes == 8 * 128 * 4  # not the u32 context words


def test_iota_and_empty_replica_groups():
    by_name = {c.name: c for c in parse_collectives(TPU_STYLE)}
    assert by_name["all-gather-start"].replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert by_name["all-reduce-start"].replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert axes_of(by_name["all-gather-start"]) == ("model",)
    assert axes_of(by_name["all-reduce-start"]) == ("data",)
    assert axes_of(by_name["collective-permute-start"]) == ("model",)
    assert by_name["all-reduce.9"].replica_groups == ()
    assert axes_of(by_name["all-reduce.9"]) == ("data", "model")


@pytest.mark.parametrize("groups, expected", [
    ("[2,2]<=[4]", ((0, 1), (2, 3))),
    ("[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
    ("[2,4]<=[2,2,2]T(1,0,2)", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("[4,2]<=[2,2,2]T(2,1,0)", ((0, 4), (2, 6), (1, 5), (3, 7))),
    ("[1,8]<=[8]", (tuple(range(8)),)),
])
def test_iota_group_semantics(groups, expected):
    text = f"%ag = f32[8]{{0}} all-gather(f32[1]{{0}} %p), replica_groups={groups}"
    (collective,) = parse_collectives(text)
    assert collective.replica_groups == expected


def test_tuple_all_reduce_sums_bytes_and_keeps_first_shape():
    combined = {c.name: c for c in parse_collectives(TPU_STYLE)}["all-reduce.9"]
    assert combined.shape == (64, 1024) and combined.dtype == "f32"
    assert combined.bytes == 64 * 1024 * 4 + 2 * 2 * 2


def test_summary_totals_per_kind():
    assert collective_summary(parse_collectives(TPU_STYLE)) == {
        "all-reduce": {"count": 2, "bytes": 256 * 1024 * 4 + 64 * 1024 * 4 + 8},
        "all-gather": {"count": 1, "bytes": 256 * 1024 * 2},
        "reduce-scatter": {"count": 1, "bytes": 64 * 1024 * 4},
        "collective-permute": {"count": 1, "bytes": 8 * 128 * 4},
    }


def test_start_without_done_is_an_error():
    text = "%ars = f32[4]{0} all-reduce-start(f32[4]{0} %x), replica_groups={}, to_apply=%add"
    with pytest.raises(ValueError, match="no matching all-reduce-done"):
        parse_collectives(text)


def test_fused_dot_and_convolution_counted_once():
    # dot.7 inside %fused_matmul, convolution.3 (a matmul, TPU style) inside %fused_conv;
    # the fusion instructions calling them add nothing.
    assert dot_flops(TPU_STYLE) == 2 * (256 * 128) * 1024 + 2 * (256 * 1024) * 128


def test_dot_flops_without_printed_operand_shapes():
    text = """\
  %a = f32[4,3,16]{2,1,0} parameter(0)
  %b = f32[4,16,8]{2,1,0} parameter(1)
  %d = f32[4,3,8]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, \
rhs_batch_dims={0}, rhs_contracting_dims={1}
"""
    assert dot_flops(text) == 2 * (4 * 3 * 8) * 16


# --- mesh axes ------------------------------------------------------------------------------

def test_mesh_axes_of_groups_varying_on_both_axes():
    assert mesh_axes_of_groups(((0, 5),), MESH_2X4, AXES) == ("data", "model")
    assert mesh_axes_of_groups(((0,), (1,)), MESH_2X4, AXES) == ()


def test_mesh_axes_empty_groups_skip_size_one_axes():
    ids = np.arange(8).reshape(1, 8)
    assert mesh_axes_of_groups((), ids, AXES) == ("model",)


def test_mesh_axes_errors():
    with pytest.raises(ValueError, match="not in the mesh"):
        mesh_axes_of_groups(((0, 9),), MESH_2X4, AXES)
    with pytest.raises(ValueError, match="axes"):
        mesh_axes_of_groups(((0, 1),), MESH_2X4, ("model",))


def test_module_imports_no_torch_at_top_level():
    source = Path(hlo.__file__).read_text()
    top_level_imports = [ln for ln in source.splitlines() if ln.startswith(("import", "from"))]
    assert top_level_imports and not any("torch" in line for line in top_level_imports)
