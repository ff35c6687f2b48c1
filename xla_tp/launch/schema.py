"""Strict YAML -> dataclass loading for recipes and TPU topology files.

Every key is checked: an unknown key is an error that names the file, the key and the closest
known key; a value of the wrong type names the key, the value and the type wanted. Example::

    @dataclass
    class Data:
        kind: str = "text"
        path: Optional[str] = None

    build(Data, {"kind": "text", "pth": "x.txt"}, "recipes/a.yaml: data")
    # LaunchError: recipes/a.yaml: data: unknown key 'pth' (did you mean 'path'?); known keys: kind, path
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import yaml

from ..errors import PlanError


class LaunchError(PlanError):
    """A recipe, topology or launch option that cannot be used; the message names it and what to do.

    A ``ValueError`` (through ``PlanError``), like every xla_tp input error.
    """


def build(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)`` after checking every key and value against ``cls``'s annotated fields."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise LaunchError(f"{where}: expected a mapping of keys to values, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise LaunchError(f"{where}: unknown key {key!r}{did_you_mean(str(key), fields)}; "
                              f"known keys: {', '.join(fields)}")
    missing = [name for name, f in fields.items() if name not in data and _required(f)]
    if missing:
        raise LaunchError(f"{where}: missing key(s) {', '.join(missing)}")
    return cls(**{key: convert(value, hints[key], f"{where}: {key}") for key, value in data.items()})


def did_you_mean(word: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked (and, for nested dataclasses, built) against the type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return convert(value, arm, where)
            except LaunchError as error:
                errors.append(str(error))
        raise LaunchError(errors[0] if len(errors) == 1 else
                          f"{where}: {value!r} is none of {' | '.join(_name(a) for a in args)}")
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LaunchError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return origin(convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise LaunchError(f"{where}: expected a mapping, got {value!r}")
        key_t, val_t = args or (Any, Any)
        return {convert(k, key_t, where): convert(v, val_t, f"{where}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise LaunchError(f"{where}: expected {_name(hint)}, got {value!r}")
    return value


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def choice(value: str, allowed: Mapping[str, Any] | tuple[str, ...], where: str) -> str:
    """``value`` if it is one of ``allowed``, else a LaunchError listing them."""
    if value not in allowed:
        raise LaunchError(f"{where}: {value!r} is not one of {', '.join(allowed)}{did_you_mean(value, allowed)}")
    return value


def positive(value: Optional[Union[int, float]], where: str, zero_ok: bool = False) -> None:
    """Refuse a negative (or zero, unless ``zero_ok``) number, naming ``where``."""
    if value is not None and (value < 0 or (value == 0 and not zero_ok)):
        raise LaunchError(f"{where}: must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")


def shipped_names(directory: Path) -> list[str]:
    """Stems of the YAML files in ``directory`` (the shipped recipes or topologies), sorted."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def find_yaml(name_or_path: Union[str, Path], directory: Path, kind: str) -> Path:
    """A shipped ``kind`` by name (``directory/NAME.yaml``) or a YAML path; LaunchError listing the names."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        names = shipped_names(directory)
        raise LaunchError(f"unknown {kind} {str(name_or_path)!r}{did_you_mean(str(name_or_path), names)}; "
                          f"known: {', '.join(names)} (or a path to a {kind} YAML file like "
                          f"{directory.name}/{names[0]}.yaml)")
    return path


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; LaunchError naming the file when it is not YAML text."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise LaunchError(f"{path}: not a YAML text file (byte {error.start} is not UTF-8 text); pass a recipe "
                          f"written as YAML") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise LaunchError(f"{path}: not valid YAML{where}: {getattr(error, 'problem', None) or error}") from None
