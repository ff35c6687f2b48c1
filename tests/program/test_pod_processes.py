"""A pod's protocol on real processes: 2-4 local Pythons joined by one gloo group (``tests/pod_processes.py``)
stand in for the hosts. A checkpoint saved by two of them is one committed ``step_N`` that one process loads
on another mesh; a process killed half-way through a save leaves the previous checkpoint intact and no hidden
directory; N processes together read each global batch exactly once, and a stop asked of one process stops
all of them after the same step. Each run is bounded (240 s).
"""
from __future__ import annotations

import json
import os

import pytest

from tests.pod_processes import finish, start


def _listing(root) -> list[str]:
    return sorted(os.listdir(root))


def test_two_processes_save_one_checkpoint_one_process_loads_it(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    saved = finish(start(2, "save", str(root), "2"))
    assert [status for status, _ in saved] == [0, 0], saved
    assert saved[0][1]["saved"] == saved[1][1]["saved"] == [str(root / "step_00000001"), str(root / "step_00000002")]
    assert [(out["loaded"], out["load_error"]) for _, out in saved] == [(2, 0.0), (2, 0.0)]   # both load it back
    assert _listing(root) == ["step_00000001", "step_00000002"]      # nothing hidden left behind
    marker = json.loads((root / "step_00000002" / "xla_tp.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(marker["files"])   # both processes' files
    [(status, loaded)] = finish(start(1, "load", str(root)))
    assert status == 0, loaded
    assert loaded == {"step": 2, "error": 0.0, "optimizer_steps": [1]}


@pytest.mark.parametrize("die", [1, 0])
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, die):
    root = tmp_path / "ckpt"
    root.mkdir()
    results = finish(start(2, "save", str(root), "2", "2", str(die)))
    assert results[die][0] == -9, results
    survivor = results[1 - die]
    assert survivor[0] == 0 and survivor[1]["saved"] == [str(root / "step_00000001")], survivor
    assert "saving step 2" in survivor[1]["error"] and "intact" in survivor[1]["error"]
    assert _listing(root) == ["step_00000001"]                        # no step 2, no hidden directory
    [(status, loaded)] = finish(start(1, "load", str(root)))
    assert status == 0 and loaded["step"] == 1 and loaded["error"] == 0.0, loaded


@pytest.mark.parametrize("n", [2, 4])
def test_processes_read_each_row_of_the_global_batch_once(n):
    results = finish(start(n, "rows", devices=8))
    assert all(status == 0 for status, _ in results), results
    assert [out["index"] for _, out in results] == list(range(n))
    assert all(out["count"] == n and out["equal"] for _, out in results)
    assert [out["stopped"] for _, out in results] == [3] * n       # one host stopped: all stop after step 3
    read = sorted(row for _, out in results for row in out["rows"])
    assert read == list(range(8))                                     # every row, each once
