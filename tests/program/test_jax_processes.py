"""The JAX backend on 2 and 4 real processes (127.0.0.1, ``jax.distributed``), one data=2 x model=4 mesh over
all their devices: the same numbers as one process (``tests/jax_processes.py`` runs them)."""
from __future__ import annotations

import pytest

from ..jax_processes import run

pytestmark = pytest.mark.complete


@pytest.fixture(scope="module")
def one_process() -> dict:
    return run(1)[0]


@pytest.mark.parametrize("n", [4])  # two processes: the launcher's --hosts 2 (test_launch_jax)
def test_processes_compute_what_one_process_computes(one_process, n):
    results = run(n)
    assert [r["rank"] for r in results] == list(range(n))
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (n, 8, 8 // n)
        # forward: whole inputs, or each process's rows assembled; whole outputs in every process
        assert r["whole"] < 1e-4 and r["from_rows"] < 1e-4, r
        # outputs="process": the rows this process's devices hold (of the data=2 split: half the batch), the
        # model's values
        half = r["rank"] // (n // 2)
        assert r["held"] == [4 * half, 4 * half + 4] and r["own_rows"] == [4, 16, 128] and r["own_error"] < 1e-4, r
        # the same program: the audit counts the collectives of one process's run
        assert r["collectives"] == one_process["collectives"], (r["collectives"], one_process["collectives"])
        # two AdamW steps and the trained weights back in the module, as in one process
        assert r["losses"] == pytest.approx(one_process["losses"], abs=1e-5)
        assert r["weights"] == pytest.approx(one_process["weights"], rel=1e-6)
    assert one_process["losses"][1] < one_process["losses"][0]
    assert one_process["collectives"]["all-reduce"] > 0
