"""The demo (torchtitan Llama, SP + loss parallel, forward/backward vs CPU) on 4 emulated devices.

A torch_xla mesh spans every device of the process, so 4 devices need a process of their own.
"""
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("mesh", ["model=4", "data=2,model=2"])
def test_demo_on_four_devices(mesh):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-m", "xla_tp.demo", "--mesh", mesh, "--tolerance", "1e-5"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("OK")
    assert "'model': " + mesh.split("model=")[1] in run.stdout
