"""The recipe launcher: ``xla-tp launch RECIPE [--topology NAME] [--dry-run] [key=value ...]``.

Recipes (``recipes/*.yaml``) name a model, a slice and a plan; topologies (``tpu_configs/*.yaml``)
describe the slices. The launcher checks memory per chip before anything is allocated, then trains
with progress, JSONL metrics and clean stops. Modules: ``recipe``/``topology`` (strict loading),
``model``, ``plans``, ``fit``, ``data``, ``train``, ``progress``, ``commands``, ``checkpoints``,
``rerun`` (an earlier run's files: resume, refuse, move aside), ``check``, ``session``, ``jax_run`` and
``hosts`` (``--backend jax [--hosts N]``) and ``main`` (the command). Example::

    from xla_tp.launch import load_recipe, load_topology
    recipe = load_recipe("tiny-llama-cpu", ["steps=20"])
    load_topology(recipe.topology).mesh        # {'data': 2, 'model': 4}
"""
from .recipe import Recipe, load_recipe, recipe_names
from .schema import LaunchError
from .topology import Topology, load_topology, topology_names

__all__ = ["LaunchError", "Recipe", "Topology", "load_recipe", "load_topology", "recipe_names", "topology_names"]
