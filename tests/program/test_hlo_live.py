"""End to end: build a sharded MLP on the XLA device, capture its partitioned HLO, read it."""
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from xla_tp.auditing.capture import capture_partitioned_hlo  # noqa: E402
from xla_tp.auditing.hlo import collective_summary, dot_flops, mesh_axes_of_groups, parse_collectives  # noqa: E402

from ..fresh import user_env  # noqa: E402

if not xr.is_spmd():
    xr.use_spmd()
(torch.ones(1, device=torch_xla.device()) * 2).cpu()  # the CPU-backward trap: run XLA once first

AXES = ("data", "model")
BATCH, HIDDEN, FFN = 8, 16, 32


def sharded_mlp(device_ids: np.ndarray) -> tuple[xs.Mesh, torch.nn.Module, torch.Tensor]:
    """Megatron MLP (colwise fc1, rowwise fc2) on a (2, 4) mesh, batch split over data."""
    mesh = xs.Mesh(device_ids, (2, 4), AXES)
    device = torch_xla.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, FFN), torch.nn.ReLU(), torch.nn.Linear(FFN, HIDDEN, bias=False)
    ).to(device)
    xs.mark_sharding(model[0].weight, mesh, ("model", None))
    xs.mark_sharding(model[0].bias, mesh, ("model",))
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))
    x = torch.randn(BATCH, HIDDEN).to(device)
    xs.mark_sharding(x, mesh, ("data", None))
    return mesh, model, x


@pytest.mark.parametrize("device_ids", [np.arange(8), np.array([0, 2, 4, 6, 1, 3, 5, 7])],
                         ids=["identity", "permuted"])
def test_megatron_mlp_forward_end_to_end(device_ids):
    mesh, model, x = sharded_mlp(device_ids)
    text = capture_partitioned_hlo([model(x)])
    collectives = parse_collectives(text)
    assert collective_summary(collectives) == {
        "all-reduce": {"count": 1, "bytes": (BATCH // 2) * HIDDEN * 4},
    }
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    assert mesh_axes_of_groups(collectives[0].replica_groups, ids, AXES) == ("model",)
    assert dot_flops(text) * 8 == 2 * 2 * BATCH * HIDDEN * FFN


def test_capture_refuses_materialised_tensors():
    _, model, x = sharded_mlp(np.arange(8))
    y = model(x)
    y.cpu()
    with pytest.raises(RuntimeError, match="no pending computation"):
        capture_partitioned_hlo([y])


CAPTURE_SCRIPT = """
import os, numpy as np, torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
if {spmd}:
    xr.use_spmd()
a = torch.randn(16, 8).to(torch_xla.device())   # before importing xla_tp, which would turn SPMD on
from xla_tp.auditing.capture import capture_partitioned_hlo, route
if {spmd}:
    xs.mark_sharding(a, xs.Mesh(np.arange(8), (8,), ("model",)), ("model", None))
if {queried}:  # the script reads torch_xla's (pre-optimisation) program itself first
    torch_xla._XLAC._get_xla_tensors_hlo([a + 1])
try:
    print(capture_partitioned_hlo([(a * 2).sum()]))
    print("route", route(), "XLA_DUMP_POST_OPTIMIZATIONS" in os.environ)
except RuntimeError as error:
    print(error)
"""


@pytest.mark.parametrize("spmd, queried, expected", [
    (True, False, "route device False"),  # torch_xla's own compiler, asked for at the first HLO query; env as it was
    pytest.param(True, True, "route jaxlib False",  # torch_xla read the variable unset before: jaxlib's XLA
                 marks=pytest.mark.complete),        # partitions it
    pytest.param(False, False, "use_spmd()",         # SPMD never turned on: refused, with what to do
                 marks=pytest.mark.complete),
])
def test_capture_takes_the_device_compiler_unless_the_process_fixed_otherwise(spmd, queried, expected):
    script = CAPTURE_SCRIPT.format(spmd=spmd, queried=queried)
    result = subprocess.run([sys.executable, "-c", script], env=user_env(), capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout, result.stdout[-2000:]
    if spmd:  # the sum over the sharded dimension is reduced, in the partitioned program
        assert "_spmd" in result.stdout and "all-reduce" in result.stdout


def test_a_program_jaxlib_cannot_compile_names_the_way_out():
    from xla_tp.auditing.capture import partition_with_jaxlib
    with pytest.raises(RuntimeError, match="(?s)could not compile.*XLA_DUMP_POST_OPTIMIZATIONS=1"):
        partition_with_jaxlib("HloModule broken\n\nENTRY %e { ROOT %x = f32[] nonsense() }", 8)
