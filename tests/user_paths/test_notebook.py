"""notebooks/quickstart.ipynb runs top to bottom on CPU (8 emulated devices), so it cannot rot, and its
install cell works the way a fresh Colab or TPU VM kernel runs it.

The kernel runs in a new virtual environment where xla_tp is not installed and no ``PYTHONPATH`` is
set, from a working directory that holds the checkout as a clone folder named ``xla_tp`` (what
``git clone`` leaves on Colab, and a folder Python would take for the package). The install cell
must pip-install the checkout and make it importable in that running kernel. The environment reuses
the suite's installed packages through a ``.pth`` line and pip runs offline (only setuptools and wheel, the
build backend, is fetched beforehand, from pip's cache after the first run), so torch is not downloaded.
"""
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from ..fresh import user_env

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def fresh_kernel(tmp_path: Path) -> KernelManager:
    """A kernel in a new virtual environment that sees the suite's packages but not xla_tp."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    suite = [p for p in sys.path if p.endswith("site-packages") and p != sysconfig.get_paths()["purelib"]]
    suite.append(sysconfig.get_paths()["purelib"])       # torch, torch_xla, transformers, ipykernel: no download
    (site / "zz_suite_packages.pth").write_text("\n".join(suite) + "\n")
    spec = tmp_path / "kernels" / "fresh"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh venv", "language": "python"}))
    return KernelManager(kernel_name="fresh", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))


def test_quickstart_installs_itself_in_a_fresh_kernel_and_executes(tmp_path):
    content = tmp_path / "content"                       # Colab's working directory, with the clone in it
    content.mkdir()
    (content / "xla_tp").symlink_to(ROOT, target_is_directory=True)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    wheels = tmp_path / "wheels"   # what pip fetches: the build backend of `pip install -e` (from its cache)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), "setuptools>=70.1", "wheel"],
                   check=True, timeout=300)
    env = {**user_env(), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    assert "PYTHONPATH" not in env
    client = NotebookClient(nb, km=fresh_kernel(tmp_path), timeout=600,
                            resources={"metadata": {"path": str(content)}})
    client.execute(env=env)
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)                # rich's styling
    assert f"xla_tp from {content / 'xla_tp' / 'xla_tp'}" in text   # the checkout's package, installed by the cell
    assert "8 CPU devices, mesh {'data': 2, 'fsdp': 1, 'model': 4}" in text
    assert "column-parallel" in text and "replicated:" in text   # the plan, with its reasons
    assert "communication bytes/device" in text               # the audit table
    assert "CPU [0, 4]" in text                               # the sharding picture
    assert "step  8  loss" in text                            # training ran (the cell asserts the loss fell)


def test_install_cell_uses_the_tpu_extra_on_a_tpu_host():
    install = nbformat.read(NOTEBOOK, as_version=4).cells[2].source
    assert 'EXTRA = "[tpu]" if on_tpu_host else "[hf]"' in install and '"-e", REPO + EXTRA' in install
    assert "sys.path.insert(0, REPO)" in install and "importlib.invalidate_caches()" in install
