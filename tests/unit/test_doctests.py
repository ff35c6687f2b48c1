"""Every ``>>>`` example in xla_tp's docstrings runs and shows what it says."""
import doctest
import importlib
import pkgutil

import pytest

import xla_tp

MODULES = sorted(m.name for m in pkgutil.walk_packages(xla_tp.__path__, "xla_tp.") if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (see output)"


def test_the_examples_are_there():
    finder = doctest.DocTestFinder()
    examples = sum(len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name)))
    assert examples >= 40, examples
