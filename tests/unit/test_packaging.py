"""setup.py's requirements: exact torch/torch_xla pins, the TPU extra, and what the tests need.

CI cannot run on a TPU, so the TPU install path is checked through its metadata: the ``tpu`` extra
asks for torch_xla's own ``tpu`` extra at the pinned version, and that extra (in the installed
torch_xla's metadata) is what pulls libtpu.
"""
import importlib.metadata
import runpy
from pathlib import Path
from unittest import mock

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def setup_kwargs() -> dict:
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    return setup.call_args.kwargs


def test_torch_and_torch_xla_are_pinned_exactly():
    reqs = {r.name: r for r in map(Requirement, setup_kwargs()["install_requires"])}
    assert str(reqs["torch"].specifier) == "==2.9.0" and str(reqs["torch_xla"].specifier) == "==2.9.0"


def test_tpu_extra_pulls_torch_xla_tpu_at_the_same_pin():
    kwargs = setup_kwargs()
    tpu = {r.name: r for r in map(Requirement, kwargs["extras_require"]["tpu"])}
    assert tpu["torch_xla"].extras == {"tpu"} and str(tpu["torch_xla"].specifier) == "==2.9.0"
    # torch_xla 2.9.0's own "tpu" extra is the one that brings the TPU runtime
    torch_xla_tpu = [r for r in map(Requirement, importlib.metadata.requires("torch_xla"))
                     if r.marker is not None and r.marker.evaluate({"extra": "tpu"})]
    assert "libtpu" in {r.name for r in torch_xla_tpu}
    assert importlib.metadata.version("torch_xla") == "2.9.0"


def test_test_extra_has_what_the_notebook_test_needs():
    names = {Requirement(r).name for r in setup_kwargs()["extras_require"]["test"]}
    assert {"pytest", "transformers", "nbclient", "nbformat", "ipykernel"} <= names


def test_readme_and_notebook_install_the_tpu_extra():
    assert 'pip install -e ".[tpu]"' in (ROOT / "README.md").read_text()
    assert '[tpu]' in (ROOT / "notebooks" / "quickstart.ipynb").read_text()


def test_the_peft_pin_imports_beside_the_torchao_pin():
    """peft 0.19 and later refuse torchao < 0.16 at their first LoRA layer; the pin is the newest that does not."""
    extras = setup_kwargs()["extras_require"]
    pins = {r.name: str(r.specifier) for name in ("peft", "torchao", "test") for r in map(Requirement, extras[name])}
    assert pins["peft"] == f"=={importlib.metadata.version('peft')}"
    assert pins["torchao"] == f"=={importlib.metadata.version('torchao')}"
    from peft.import_utils import is_torchao_available
    assert is_torchao_available()  # raises ImportError for a peft that refuses this torchao
