"""notebooks/quickstart.ipynb runs top to bottom on CPU (8 emulated devices), so it cannot rot."""
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from .fresh import user_env

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel gets what a user's environment has, plus this checkout on the import path (in place of
    # the install cell's `pip install -e .[tpu]`, which it then skips).
    env = {**user_env(), "PYTHONPATH": str(ROOT)}
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    text = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)                # rich's styling
    assert "8 CPU devices, mesh {'data': 2, 'fsdp': 1, 'model': 4}" in text
    assert "column-parallel" in text and "replicated:" in text   # the plan, with its reasons
    assert "communication bytes/device" in text               # the audit table
    assert "CPU [0, 4]" in text                               # the sharding picture
    assert "step  8  loss" in text                            # training ran (the cell asserts the loss fell)


def test_install_cell_uses_the_tpu_extra():
    install = nbformat.read(NOTEBOOK, as_version=4).cells[2].source
    assert '"-e", f"{REPO}[tpu]"' in install and 'find_spec("xla_tp") is None' in install
