"""Test session set-up: 8 emulated XLA CPU devices, SPMD on, post-partition HLO readable.

The environment must be set before torch_xla is imported (FACTS.md), and the XLA runtime must
execute something before any CPU backward runs in the process (the CPU-backward trap).
"""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

from xla_tp.mesh import ensure_runtime  # noqa: E402

from .titan import titan_single_call  # noqa: E402,F401  (session fixture: multi-call and plain-script tests)

ensure_runtime()


@pytest.fixture(autouse=True)
def _no_global_mesh():
    """Each test starts without a global mesh (make_mesh sets one)."""
    xs.set_global_mesh(None)
    yield
    xs.set_global_mesh(None)
