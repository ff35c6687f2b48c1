"""Plan keys -> module (or parameter) FQNs, the way torch matches them, plus ``re:`` keys and suggestions.

Key syntax:

- A plain key is split on ``.`` and each segment is matched with ``fnmatch`` against the FQN's
  segment (torch's ``parallelize_module`` rule): ``layers.*.attention.wq``. HF plans use the same
  syntax (HF replaces layer numbers by ``*`` and looks the result up, which this subsumes).
- ``re:<regex>`` matches the whole FQN (``re.fullmatch``): ``re:layers\\.[0-3]\\.attention\\.w[qkv]``.
- ``""`` is the root module.

Precedence (what ``normalize.build_layout`` does with these functions):

1. Keys are matched against module FQNs first. When several keys match one module, the most
   specific kind wins: exact, then wildcard, then regex. Two keys of the same kind on one module
   are ambiguous (``PlanError``): the plan's order never decides.
2. Keys that match no module are matched against parameter FQNs (``experts.gate_up_proj``,
   ``lm_head.weight``), with the same precedence. A parameter key plans that one parameter and
   overrides whatever a module key says about it (HF: a parameter's own rule beats its parent's).
3. Keys that match nothing are errors in strict mode (warnings otherwise), each with the closest
   real FQNs suggested (``suggest``), wildcard forms included (``layers.*.fc1``).

Ordered rule lists (``re.search``, first match wins) are resolved per parameter in ``rules.py``
into exact parameter keys, so they never compete here.

Example:

>>> match_keys(["layers.*.wq", "norm"], ["", "layers", "layers.0", "layers.0.wq"])
({'layers.0.wq': 'layers.*.wq'}, ['norm'])
"""
from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from typing import Callable, Iterable, Sequence

from ..errors import PlanError

EXACT, WILDCARD, REGEX = 0, 1, 2
_WILDCARD_CHARS = set("*?[")
_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def key_kind(key: str) -> int:
    """``EXACT`` (0), ``WILDCARD`` (1) or ``REGEX`` (2): lower is more specific."""
    if key.startswith("re:"):
        return REGEX
    return WILDCARD if _WILDCARD_CHARS & set(key) else EXACT


def key_matches(key: str, fqn: str) -> bool:
    """``key_matches("layers.*.wq", "layers.3.wq")`` is True; ``"layers.*"`` does not match ``"layers.3.wq"``."""
    if key.startswith("re:"):
        try:
            return re.fullmatch(key[3:], fqn) is not None
        except re.error as e:
            raise PlanError(f"plan key {key!r}: invalid regular expression: {e}") from None
    if key == "" or fqn == "":
        return key == fqn
    return _segments(key)(fqn.split("."))


def _segments(key: str) -> Callable[[list[str]], bool]:
    """Whether an FQN's segments match the (not regex, not empty) ``key``'s, one by one: a segment without a
    wildcard compared as it is (the same answer as ``fnmatchcase``, without building a pattern)."""
    parts = [(p, bool(_WILDCARD_CHARS & set(p))) for p in key.split(".")]
    return lambda names: len(parts) == len(names) and all(
        fnmatchcase(n, p) if wild else n == p for n, (p, wild) in zip(names, parts))


def match_keys(keys: Iterable[str], fqns: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Return (module FQN -> winning key, keys that matched nothing).

    The most specific kind among the keys matching an FQN wins; a tie at that kind is ambiguous,
    whatever the order of the keys.
    """
    hits: dict[str, list[str]] = {}
    unused: list[str] = []
    split = [(fqn, fqn.split(".")) for fqn in fqns if fqn]  # once for every key (a 70B model: a thousand modules)
    for key in keys:
        if key.startswith("re:") or key == "":
            matched = [fqn for fqn in fqns if key_matches(key, fqn)]
        else:
            matches = _segments(key)
            matched = [fqn for fqn, names in split if matches(names)]
        for fqn in matched:
            hits.setdefault(fqn, []).append(key)
        if not matched:
            unused.append(key)
    best: dict[str, str] = {}
    for fqn, candidates in hits.items():
        kind = min(map(key_kind, candidates))
        tied = [k for k in candidates if key_kind(k) == kind]
        if len(tied) > 1:
            raise PlanError(f"plan keys {tied[0]!r} and {tied[1]!r} both match {fqn!r}; "
                            f"make one of them more specific or remove one")
        best[fqn] = tied[0]
    return best, unused


def suggest(key: str, fqns: Sequence[str], n: int = 3) -> list[str]:
    """The closest real FQNs (and their wildcard forms) to a key that matched nothing."""
    pool = sorted(set(fqns) | {_DIGITS.sub("*", f) for f in fqns} - {""})
    return difflib.get_close_matches(key.removeprefix("re:"), pool, n=n, cutoff=0.5)
