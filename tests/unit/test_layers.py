"""The package's layers import one way: core <- runtime <- front ends, and the core needs no torch_xla.

Read from the source (``ast``): every ``import`` of every module, at its top or inside a function,
followed through the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "xla_tp"

# plan input -> Plan -> Layout -> validation (no runtime, no torch_xla)
CORE = ("axes", "batch", "errors", "plan", "dataflow", "planners", "validate")
# what a parallelized model runs with: its state, the compatibility effects, the lowering, the backends
RUNTIME = ("adapters", "weak", "apply", "deferred", "state", "compat", "constraints", "lowering", "guard", "optim", "inference", "recompute", "dynamo",
           "backends", "mesh", "report", "loss", "bitcast", "compiles", "processes")
# what users call: parallelize (torch_xla, JAX), audit, checkpoints, the launcher, the CLI, the model zoo
FRONT = ("api", "context_parallel", "backends.jax", "backends.dtensor", "auditing", "checkpoint", "launch", "console", "compile_cache", "cli", "zoo", "generation", "__init__")
ADAPTER_PACKAGES = ("torch_xla", "jax", "jaxlib", "torchax")
MODULES: dict[str, Path] = {}


def _module_name(path: Path) -> str:
    """``xla_tp/plan/hf.py`` -> ``xla_tp.plan.hf``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:  # a submodule, or a name defined in ``base``
                name = f"{base}.{alias.name}"
                found.add(name if name in MODULES else base)
    return found


def _layer(module: str) -> int | None:
    """0 core, 1 runtime, 2 front end, None outside the package (the longest matching entry decides)."""
    parts = module.split(".")
    if parts[0] != "xla_tp":
        return None
    inner = ".".join(parts[1:]) or "__init__"
    best = None
    for rank, layer in enumerate((CORE, RUNTIME, FRONT)):
        for entry in layer:
            if (inner == entry or inner.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (rank, entry)
    if best is None:
        raise AssertionError(f"{module}: not in any layer; add it to CORE, RUNTIME or FRONT in tests/unit/test_layers.py")
    return best[0]


MODULES.update({_module_name(p): p for p in PACKAGE.rglob("*.py")})


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) in (0, 1)))
def test_no_module_imports_a_higher_layer(name):
    rank = _layer(name)
    higher = sorted(i for i in _imports(MODULES[name]) if (_layer(i) or 0) > rank)
    assert not higher, f"{name} (layer {rank}) imports {higher}"


def test_the_core_needs_no_torch_xla_or_jax():
    """Nothing the core imports, followed through the package, is torch_xla or jax."""
    core = [n for n in MODULES if _layer(n) == 0]
    for name in core:
        adapters = sorted(i for i in _imports(MODULES[name]) if i.split(".")[0] in ADAPTER_PACKAGES)
        assert not adapters, f"{name} imports {adapters}"


def test_the_audit_function_and_its_package_do_not_collide():
    import xla_tp
    import xla_tp.auditing.run
    assert callable(xla_tp.audit) and xla_tp.audit is xla_tp.auditing.run.audit


def _cycle() -> list[str]:
    """One import cycle between the package's files (imports inside functions included), or []."""
    graph = {name: sorted(i for i in _imports(path) if i in MODULES and i != name)
             for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return []
        for nxt in graph[name]:
            found = visit(nxt, path + [name])
            if found:
                return found
        done.add(name)
        return []

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return []


def test_no_import_cycle_between_files():
    cycle = _cycle()
    assert not cycle, " -> ".join(cycle)
