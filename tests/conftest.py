"""Test session set-up: 8 emulated XLA CPU devices, SPMD on, post-partition HLO readable.

The environment must be set before torch_xla is imported (docs/torch_xla.md), and the XLA runtime must
execute something before any CPU backward runs in the process (the CPU-backward trap). The CPU backend compiles
with LLVM at -O0 (``--xla_backend_optimization_level=0``): XLA's HLO passes, the SPMD partitioner and so the
partitioned program the tests read are unchanged, and compiling takes about half the CPU time. Tests that run a
script as a user does (``fresh.run_fresh``) get none of these variables. In the torch_xla-free environment
(``bash scripts/dev.sh complete`` runs the files marked ``pytestmark = pytest.mark.core`` there, which need torch
only) there is nothing of this to set up.
"""
import importlib.util
import os

from .fresh import FAST_COMPILE

XLA = importlib.util.find_spec("torch_xla") is not None

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("XLA_DUMP_POST_OPTIMIZATIONS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), FAST_COMPILE["XLA_FLAGS"]]).strip()

import pytest  # noqa: E402

if XLA:
    import torch_xla.distributed.spmd as xs

    from xla_tp.mesh import ensure_runtime

    from .titan import titan_single_call  # noqa: F401  (session fixture: multi-call and plain-script tests)

    ensure_runtime()


# the files that take longest, slowest first: ``-n 2 --dist loadfile`` hands files out in collection order,
# so these start at once and the short ones fill the gaps at the end (not one long file alone at the end)
SLOW_FIRST = ("test_launch_run.py", "test_dynamo.py", "test_bench.py", "test_families.py", "test_audit_user_path.py",
              "test_generate.py", "test_backward.py", "test_auto_any_model.py", "test_moe.py", "test_launch_fit.py",
              "test_call_order.py", "test_jax_user_path.py", "test_readme.py", "test_meta_init.py")


# the complete tier (``bash scripts/dev.sh complete``; CI runs it after the quick tier): whole files here, single
# tests marked ``@pytest.mark.complete`` where they are; the quick tier (``bash scripts/dev.sh test``) is the rest
COMPLETE_FILES = ("test_moe_looped.py", "test_launch_run.py", "test_dynamo.py", "test_bench.py", "test_notebook.py",
                  "test_meta_init.py", "test_scoped.py", "test_generate_cli.py", "test_pod_processes.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "complete: in the complete tier only (CI runs both tiers)")
    config.addinivalue_line("markers", "core: needs torch only (the complete tier runs it without torch_xla too)")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest as collected
    for item in items:
        if item.path.name in COMPLETE_FILES:
            item.add_marker(pytest.mark.complete)


@pytest.fixture(autouse=True)
def _no_global_mesh():
    """Each test starts without a global mesh (make_mesh sets one)."""
    if XLA:
        xs.set_global_mesh(None)
    yield
    if XLA:
        xs.set_global_mesh(None)


@pytest.fixture
def tiny_llama():
    """The suite's tiny grouped-query Llama builder (``tests/hf_tiny.py``): ``tiny_llama(seed=0, **overrides)``."""
    from .hf_tiny import tiny_llama as build
    return build
