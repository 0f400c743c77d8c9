"""Short op-site names for chart ticks: the part that tells op sites apart stays readable.

A transformer's op sites share long prefixes ("encoder.layer.0.attention.self.query_proj"): cutting the name at
its end leaves every tick reading "encoder.layer.0.atten…". Instead the prefix every name shares is left out
(the axis title says which), then the leading dotted parts are abbreviated to their first letter, left to right,
numbers kept ("e.l.0.attention.self.query_proj"), until the name fits; a name still too long keeps its tail
after an ellipsis. The full name stays in each point's tooltip.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["common_prefix", "short_name", "short_names"]

_ELLIPSIS = "\u2026"


def common_prefix(names: Sequence[str]) -> str:
    """The dotted parts every name of ``names`` (two or more) starts with, with their trailing dot ("" for
    none); a name is never left empty."""
    if len(names) < 2:
        return ""
    split = [n.split(".") for n in names]
    shared = 0
    # never all of a name's parts: something must stay to show
    while all(len(s) > shared + 1 for s in split) and len({s[shared] for s in split}) == 1:
        shared += 1
    return "".join(p + "." for p in split[0][:shared])


def _abbreviated(name: str, k: int) -> str:
    """``name`` with its first ``k`` abbreviable leading parts (not numbers, not the last part) cut to one
    letter."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if k <= 0:
            break
        if not parts[i].isdigit() and len(parts[i]) > 1:
            parts[i], k = parts[i][0], k - 1
    return ".".join(parts)


def _needed(name: str, limit: int) -> int:
    """How many leading parts :func:`_abbreviated` must cut for ``name`` to fit ``limit`` (all it can, if none
    is enough)."""
    k = 0
    while len(_abbreviated(name, k)) > limit and _abbreviated(name, k + 1) != _abbreviated(name, k):
        k += 1
    return k


def _fit(name: str, k: int, limit: int) -> str:
    short = _abbreviated(name, k)
    return short if len(short) <= limit else _ELLIPSIS + name[-(limit - 1):]


def short_name(name: str, limit: int) -> str:
    """``name`` in at most ``limit`` characters: leading dotted parts abbreviated to their first letter, left
    to right, numeric parts kept; still too long, its last ``limit - 1`` characters after an ellipsis."""
    return _fit(name, _needed(name, limit), limit)


def short_names(names: Sequence[str], limit: int = 30) -> tuple[list[str], str]:
    """Tick texts for ``names`` and the prefix left out of all of them (see the module docstring). Op sites of
    one module (the same name but its last part) are abbreviated alike, so neighbouring ticks read alike; names
    the abbreviation would make equal keep their tail instead (``…`` and the last ``limit - 1`` characters)."""
    prefix = common_prefix(names)
    rest = [n[len(prefix):] for n in names]
    parent = [n.rpartition(".")[0] for n in rest]
    depth: dict[str, int] = {}
    for n, p in zip(rest, parent):
        depth[p] = max(depth.get(p, 0), _needed(n, limit))
    short = [_fit(n, depth[p], limit) for n, p in zip(rest, parent)]
    seen: dict[str, set[str]] = {}
    for full, s in zip(rest, short):
        seen.setdefault(s, set()).add(full)
    clash = {s for s, fulls in seen.items() if len(fulls) > 1}
    short = [(_ELLIPSIS + full[-(limit - 1):] if len(full) > limit else full) if s in clash else s
             for full, s in zip(rest, short)]
    return short, prefix
