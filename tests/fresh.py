"""Run a script the way a user does: a fresh Python, only PJRT_DEVICE/CPU_NUM_DEVICES (plus PATH/HOME).

The test session's own variables (``XLA_DUMP_POST_OPTIMIZATIONS`` from conftest) never reach it. A test that
needs a fresh process for isolation, not as a user path (one process per compared run), may ask for the
suite's faster CPU compiles (``fast_compile``: LLVM at -O0, same partitioned program).
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


FAST_COMPILE = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}


def run_fresh(script: str, timeout: int = 600, *, fast_compile: bool = False) -> str:
    """stdout of ``python -c script`` run from the repository root; fails the test with stderr otherwise."""
    env = {**user_env(), **(FAST_COMPILE if fast_compile else {})}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"exit status {result.returncode}:\n" + _errors(result.stderr)[-4000:]
    return result.stdout


def _errors(stderr: str) -> str:
    """stderr without XLA's per-compile deprecation warning, which would push the error out of the message."""
    return "\n".join(line for line in stderr.splitlines() if "GSPMD sharding propagation is going to be" not in line)
