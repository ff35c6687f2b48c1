"""Run a script the way a user does: a fresh Python, only PJRT_DEVICE/CPU_NUM_DEVICES (plus PATH/HOME).

The test session's own variables (``XLA_DUMP_POST_OPTIMIZATIONS`` from conftest) never reach it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def user_env(devices: int = 8) -> dict[str, str]:
    env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    return env


def run_fresh(script: str, timeout: int = 600) -> str:
    """stdout of ``python -c script`` run from the repository root; fails the test with stderr otherwise."""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=user_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
