"""``parallelize_jax`` without what it needs, in a fresh process with only the variables a user sets. (The
README's own example runs, and is checked, in tests/user_paths/test_readme.py.)"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NO_JAX = """
import sys
sys.modules["jax"] = None          # as if the [jax] extra were not installed
import torch, xla_tp
try:
    xla_tp.parallelize_jax(torch.nn.Linear(4, 4), mesh={"model": 1})
except ImportError as e:
    print("ImportError:", e)
"""


def _run(script: str) -> str:
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_without_the_jax_extra_the_error_says_what_to_install():
    assert "pip install 'xla_tp[jax]'" in _run(NO_JAX)


FLAX_AT_IMPORT = """
import sys
sys.path.insert(0, sys.argv[1])
from xla_tp.backends.torchax import import_torchax
torchax = import_torchax()
print("flax left behind", any(name.split(".")[0] == "flax" for name in sys.modules))
try:
    torchax.checkpoints.restore_checkpoint
except ImportError as e:
    print("ImportError:", e)
"""


def test_a_torchax_build_that_imports_flax_at_import_time(tmp_path):
    """Some torchax 0.0.13 builds on package indexes import flax on import; flax is not a dependency."""
    (tmp_path / "torchax").mkdir()
    (tmp_path / "torchax" / "__init__.py").write_text("from flax.training import checkpoints\n")
    (tmp_path / "torchax" / "interop.py").write_text("")
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    result = subprocess.run([sys.executable, "-c", FLAX_AT_IMPORT, str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flax left behind False" in result.stdout
    assert "pip install flax" in result.stdout
