"""Recipes (``recipes/*.yaml``): a model, a slice, a plan and a training setup, read strictly.

A recipe names a model (a transformers config class with overrides, or a config dict), the
topology it is meant for, a plan (``auto``, ``hf``, an inline rule mapping or a plan file), the
mesh (default: the topology's), optimizer, precision, data, steps, global batch, sequence length,
activation checkpointing, checkpoints and logging. ``extends: other-recipe`` starts from another
recipe. ``key=value`` overrides from the command line use dotted keys and YAML values. Example::

    recipe = load_recipe("tiny-llama-cpu", ["steps=20", "optimizer.lr=1.0e-3"])
    recipe.steps, recipe.optimizer.lr       # 20, 0.001
    load_recipe("tiny-llama-cpu", ["optimiser.lr=1"])   # LaunchError: unknown key 'optimiser' ...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ..axes import batch_ways
from .schema import LaunchError, build, choice, find_yaml, positive, read_yaml, shipped_names
from .topology import Topology, check_mesh

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = "tiny-llama-cpu"

TASKS = ("causal-lm", "masked-lm")
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine")
DATA_KINDS = ("text", "tokens", "synthetic")


@dataclass
class ModelSpec:
    """``config``: a transformers config class name (``LlamaConfig``) or a dict with ``model_type``."""

    config: Union[str, dict[str, Any]]
    task: str = "causal-lm"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 3.0e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    momentum: float = 0.0                 # sgd only
    warmup_steps: int = 0
    schedule: str = "constant"            # constant | cosine (to 10% of lr at the last step)
    grad_clip: Optional[float] = None     # max global gradient norm


@dataclass
class DataSpec:
    """``text``: a UTF-8 file read as bytes (ids 0-255); ``tokens``: a ``.npy`` array of token ids;
    ``synthetic``: uniform random ids (for throughput and fit runs)."""

    kind: str = "text"
    path: Optional[str] = None


@dataclass
class CheckpointSpec:
    dir: Optional[str] = None
    interval: int = 0                     # steps between checkpoints; 0: none
    keep: int = 3                         # the newest complete checkpoints kept


@dataclass
class Recipe:
    model: ModelSpec
    steps: int
    batch: int                            # global batch (sequences per step, all chips together)
    seq_len: int
    topology: str = "cpu-8"
    plan: Union[str, dict[str, Any]] = "auto"
    mesh: Optional[dict[str, int]] = None  # default: the topology's mesh
    precision: str = "fp32"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    activation_checkpointing: bool = False
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    log_interval: int = 10
    seed: int = 0
    check_tolerance: float = 1.0e-4       # --check: max error against the unsharded CPU model
    description: str = ""
    name: str = ""                        # set by the loader: the file's stem
    path: str = ""                        # set by the loader

    def mesh_for(self, topology: Topology) -> dict[str, int]:
        """The recipe's mesh, or the topology's default."""
        return dict(self.mesh) if self.mesh is not None else dict(topology.mesh)


def recipe_names() -> list[str]:
    """Names of the shipped recipes (file stems of ``recipes/``), sorted."""
    return shipped_names(RECIPE_DIR)


def load_recipe(name_or_path: Union[str, Path], overrides: Optional[list[str]] = None) -> Recipe:
    """Read a recipe (following ``extends``), apply ``key=value`` overrides, check every key."""
    path = find_yaml(name_or_path, RECIPE_DIR, "recipe")
    data = _read_with_base(path, seen=())
    for item in overrides or ():
        apply_override(data, item)
    recipe = build(Recipe, {**data, "name": path.stem, "path": str(path)}, str(path))
    check_fields(recipe, str(path))
    return recipe


def _read_with_base(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path in seen:
        raise LaunchError(f"{path}: 'extends' loops back to itself ({' -> '.join(map(str, (*seen, path)))})")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise LaunchError(f"{path}: a recipe is a mapping of keys to values")
    base = data.pop("extends", None)
    if base is None:
        return data
    return merge(_read_with_base(find_yaml(base, RECIPE_DIR, "recipe"), (*seen, path)), data)


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``; mappings merge key by key. ``merge({"a": {"x": 1}}, {"a": {"y": 2}})``
    is ``{"a": {"x": 1, "y": 2}}``."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_value(text: str) -> Any:
    """A command-line value as YAML (``8``, ``true``, ``{data: 2, model: 4}``); ``1e-3`` is a float."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LaunchError(f"override value {text!r} is not valid YAML: {error}") from None
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def apply_override(data: dict[str, Any], item: str) -> None:
    """``apply_override(d, "optimizer.lr=1e-3")`` sets ``d["optimizer"]["lr"] = 0.001``."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise LaunchError(f"override {item!r}: write key=value, e.g. steps=20 or optimizer.lr=1e-3")
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise LaunchError(f"override {item!r}: {'.'.join(parents[:i + 1])} is {child!r}, not a mapping")
        node = child
    node[leaf] = parse_value(text)


def check_fields(recipe: Recipe, where: str) -> None:
    """Value checks that need no other file: choices, positive numbers, the plan's form."""
    choice(recipe.model.task, TASKS, f"{where}: model.task")
    choice(recipe.precision, PRECISIONS, f"{where}: precision")
    choice(recipe.optimizer.name, OPTIMIZERS, f"{where}: optimizer.name")
    choice(recipe.optimizer.schedule, SCHEDULES, f"{where}: optimizer.schedule")
    choice(recipe.data.kind, DATA_KINDS, f"{where}: data.kind")
    for key in ("steps", "checkpoint.interval", "optimizer.warmup_steps", "optimizer.weight_decay"):
        positive(_get(recipe, key), f"{where}: {key}", zero_ok=True)
    for key in ("batch", "seq_len", "log_interval", "optimizer.lr", "check_tolerance", "optimizer.grad_clip"):
        positive(_get(recipe, key), f"{where}: {key}")
    if recipe.seq_len < 2:
        raise LaunchError(f"{where}: seq_len must be >= 2 (inputs and next-token targets), got {recipe.seq_len}")
    if len(recipe.optimizer.betas) != 2 or not all(0 <= b < 1 for b in recipe.optimizer.betas):
        raise LaunchError(f"{where}: optimizer.betas must be two numbers in [0, 1), got {recipe.optimizer.betas}")
    if recipe.data.kind != "synthetic" and not recipe.data.path:
        raise LaunchError(f"{where}: data.kind {recipe.data.kind!r} needs data.path")
    if recipe.checkpoint.interval and not recipe.checkpoint.dir:
        raise LaunchError(f"{where}: checkpoint.interval={recipe.checkpoint.interval} needs checkpoint.dir")
    if isinstance(recipe.plan, str) and recipe.plan not in ("auto", "hf"):
        plan_file(recipe.plan, where)


def check_for_topology(recipe: Recipe, topology: Topology) -> dict[str, int]:
    """The mesh the run uses, checked against the slice and the batch; returns it."""
    mesh = recipe.mesh_for(topology)
    where = f"{recipe.path}: mesh" if recipe.mesh is not None else f"topology {topology.name}: mesh"
    check_mesh(mesh, topology.chips, where)
    if topology.slices > 1:
        from .slices import hybrid_shapes
        hybrid_shapes(mesh, topology.slices)      # the data axis crosses the slices
    ways = batch_ways(mesh)
    if recipe.batch % ways:
        raise LaunchError(f"{recipe.path}: batch={recipe.batch} does not divide over data x fsdp = {ways} "
                          f"(mesh {mesh}); use a multiple of {ways}")
    context = mesh.get("context", 1)
    if recipe.seq_len % context:
        raise LaunchError(f"{recipe.path}: seq_len={recipe.seq_len} does not divide over context = {context} "
                          f"(mesh {mesh}): the sequence would stay whole; use a multiple of {context}")
    return mesh


def plan_file(text: str, where: str) -> Path:
    """A plan given as a file name: the YAML file, relative to the current directory or the repo."""
    path = resolve_path(text)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        raise LaunchError(f"{where}: plan {text!r} is not 'auto', 'hf', a mapping of rules, or an existing "
                          f"YAML plan file")
    return path


def resolve_path(text: str) -> Path:
    """A relative path from the current directory if it exists there, else from the repository root."""
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def _get(recipe: Recipe, dotted: str) -> Any:
    value: Any = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
