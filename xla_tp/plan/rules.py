"""Rule lists: per-dimension mesh axes by FQN, as JAX and torchprime users write them.

Two forms, both lowered to plan dicts whose values are ``AxisRule`` styles (which lower through
``ShardParams``), so they go through the same matching, validation and backends as every plan:

- **YAML / dict (torchprime)**: FQN pattern -> one mesh axis (or ``null``, or a list of axes) per
  dimension. A pattern that names a parameter shards it; one that names a module constrains its
  output; ``[i]`` selects element ``i`` of a tuple output; ``""`` is the root module::

      model.embed_tokens.weight: [fsdp, model]
      model.layers.*.self_attn.q_proj.weight: [model, fsdp]
      model.layers.*: [data, null, model]          # the decoder layer's output activation
      model.layers.*[0]: [data, null, model]       # same, for a layer returning a tuple

  ``load_rules(text_or_path_or_dict)`` returns the plan. Unused rules fail in strict mode (the
  default of ``parallelize_xla``) with suggestions, like any plan key.
- **Ordered regex list (EasyDeL / JAX)**: ``[(regex, spec), ...]``; for each parameter the first
  rule whose regex ``re.search``-es its FQN wins. ``regex_plan(model, rules)`` resolves it to exact
  parameter keys; with ``strict`` a rule that matches nothing, or only parameters taken by earlier
  rules, is a ``PlanError``. An empty spec ``()`` means replicated.

Axis names go through ``mesh.canonical_axis`` (``tp``/``tensor`` -> ``model``, ``dp`` -> ``data``).
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import yaml
from torch import nn

from ..axes import canonical_axis
from ..errors import PlanError
from .layout import Axis, ModuleLayout, Spec
from .styles import ShardParams, Style

_INDEX = re.compile(r"^(.*)\[(\d+)\]$")


@dataclass(frozen=True)
class AxisRule(Style):
    """Mesh axes for what its key names: a parameter's spec, or a module's output specs by index.

    Example: ``AxisRule((("data", None, "model"),))`` on ``layers.*`` constrains each layer's output.
    """

    specs: tuple[Optional[Spec], ...]
    indexed: bool = False  # the key had an ``[i]`` suffix: it can only name a module

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        outputs = tuple((s,) if s is not None else () for s in self.specs)
        return _with_style(ShardParams(outputs=outputs).lower(fqn, module, key, tp_axis), self)

    def lower_param(self, fqn: str, module: nn.Module, param: str, key: str, tp_axis: str) -> ModuleLayout:
        if self.indexed:
            raise PlanError(f"plan key {key!r} names parameter {param!r} of {fqn or '<root>'!r}; a "
                            f"parameter has no tuple elements, so drop the [i] suffix")
        return _with_style(ShardParams(params={param: self.specs[0]}).lower(fqn, module, key, tp_axis), self)


def _with_style(ml: ModuleLayout, rule: AxisRule) -> ModuleLayout:
    ml.style = f"rule {list(rule.specs[0]) if len(rule.specs) == 1 else rule.specs}"
    return ml


def to_spec(value: Any, key: str) -> Spec:
    """One rule value -> a spec. ``to_spec(["tp", None, ["data", "fsdp"]], k) == ("model", None, ("data", "fsdp"))``"""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise PlanError(f"rule {key!r}: {value!r} is not a list of mesh axes, one per dimension "
                        f"(e.g. [model, null])")
    return tuple(_to_axis(v, key) for v in value)


def _to_axis(value: Any, key: str) -> Axis:
    if value is None:
        return None
    if isinstance(value, str):
        return canonical_axis(value)
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return tuple(canonical_axis(v) for v in value)
    raise PlanError(f"rule {key!r}: {value!r} is not a mesh axis name, null, or a list of axis names")


def load_rules(source: Union[str, os.PathLike, Mapping[str, Any]]) -> dict[str, AxisRule]:
    """A torchprime-style rule mapping (dict, YAML text, or YAML file path) -> plan dict.

    A top-level ``sharding:`` mapping is unwrapped. Example:

    >>> load_rules("model.layers.*.mlp.up_proj.weight: [tp, null]")
    {'model.layers.*.mlp.up_proj.weight': AxisRule(specs=(('model', None),), indexed=False)}
    """
    rules = _read(source)
    grouped: dict[str, dict[int, Spec]] = {}
    indexed: set[str] = set()
    for raw_key, value in rules.items():
        key, index = _split_index(str(raw_key))
        by_index = grouped.setdefault(key, {})
        if (index or 0) in by_index:
            raise PlanError(f"rule {raw_key!r}: {key!r} output {index or 0} is given twice ('x' means 'x[0]')")
        by_index[index or 0] = to_spec(value, str(raw_key))
        if index is not None:
            indexed.add(key)
    return {key: AxisRule(tuple(by.get(i) for i in range(max(by) + 1)), key in indexed)
            for key, by in grouped.items()}


def _read(source: Union[str, os.PathLike, Mapping[str, Any]]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        data: Any = source
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                              and source.endswith((".yaml", ".yml"))):
        with open(source) as f:
            data = yaml.safe_load(f)
    else:
        data = yaml.safe_load(source)
    if isinstance(data, Mapping) and set(data) == {"sharding"}:
        data = data["sharding"]
    if not isinstance(data, Mapping):
        raise PlanError(f"sharding rules must be a mapping of FQN pattern -> [axis, ...], got "
                        f"{type(data).__name__}")
    return data


def _split_index(key: str) -> tuple[str, Optional[int]]:
    """``_split_index("layers.*[1]") == ("layers.*", 1)``; ``_split_index("x") == ("x", None)``."""
    m = _INDEX.match(key)
    return (m.group(1), int(m.group(2))) if m else (key, None)


RuleList = Sequence[tuple[str, Any]]


def regex_plan(module: nn.Module, rules: RuleList, strict: bool = True) -> dict[str, AxisRule]:
    """Resolve an ordered ``(regex, spec)`` list against ``module``'s parameters; first match wins.

    Example:

    >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> plan = regex_plan(mlp, [(r"^0\\.weight$", ("model", None)), (r".*", ())])
    >>> plan["0.weight"], plan["0.bias"]
    (AxisRule(specs=(('model', None),), indexed=False), AxisRule(specs=((None,),), indexed=False))
    """
    compiled = [(_compile(pattern), to_spec(spec, pattern)) for pattern, spec in rules]
    plan: dict[str, AxisRule] = {}
    hits = [0] * len(compiled)
    for name, p in module.named_parameters():
        for i, (regex, spec) in enumerate(compiled):
            if regex.search(name):
                hits[i] += 1
                plan[name] = AxisRule((spec or (None,) * p.dim(),))
                break
    if strict:
        _check_all_used(rules, compiled, hits, [n for n, _ in module.named_parameters()])
    return plan


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise PlanError(f"rule {pattern!r}: invalid regular expression: {e}") from None


def _check_all_used(rules: RuleList, compiled: list, hits: list[int], names: list[str]) -> None:
    """Every rule must win at least one parameter: unmatched and shadowed rules are errors."""
    problems = []
    for (pattern, _), (regex, _), n in zip(rules, compiled, hits):
        if n:
            continue
        if any(regex.search(name) for name in names):
            problems.append(f"{pattern!r} only matches parameters that earlier rules already took "
                            f"(move it up or remove it)")
        else:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            problems.append(f"{pattern!r} matches no parameter (closest: {', '.join(map(repr, close)) or 'none'})")
    if problems:
        raise PlanError("unused sharding rules: " + "; ".join(problems) + ". Fix them or pass strict=False")
