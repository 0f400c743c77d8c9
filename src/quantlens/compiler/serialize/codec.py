"""JSON encoding of the IR values a header holds (attrs, meta, non-tensor input leaves).

Strict JSON has no NaN literal, no tuple and only string keys, so: a non-finite float is
``{"$float": "nan" | "inf" | "-inf"}``, a tuple is ``{"$tuple": [...]}``, and a dict whose keys are not all plain
strings (or start with ``$``) is ``{"$dict": [[key, value], ...]}``. ``decode_value(encode_value(v))`` equals ``v`` and has
its type.
"""

from __future__ import annotations

import math
from typing import Any

from quantlens.errors import QuantLensError


def encode_value(value: Any, where: str) -> Any:
    """A strict-JSON form of ``value`` that ``decode_value`` turns back into an equal value of the same type."""
    if value is None or type(value) in (bool, str):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(value) is list:
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"$tuple": [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": [[encode_value(k, f"{where} key"), encode_value(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise QuantLensError(
        f"{where} has type {type(value).__module__}.{type(value).__qualname__} ({value!r:.80}), which the IR file "
        "cannot store. Attributes, meta and non-tensor input leaves must be None, bool, int, float, str, or "
        "lists/tuples/dicts of these. Convert the value (e.g. an enum to its .value) before saving."
    )


_MAX_DEPTH = 64  # nesting of attrs, meta and input leaf values (save writes a few levels)


def decode_value(value: Any, depth: int = 0) -> Any:
    """The value that :func:`encode_value` wrote (refusing nesting deeper than the file format allows)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"a value is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, list):
        return [decode_value(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, body), = value.items()
            if tag == "$float":
                if body not in ("nan", "inf", "-inf"):
                    raise ValueError(f"bad $float value {body!r}")
                return float(body)
            if tag == "$tuple":
                return tuple(decode_value(v, depth + 1) for v in _as_list(body, "$tuple"))
            if tag == "$dict":
                pairs = _as_list(body, "$dict")
                if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                    raise ValueError("$dict must hold [key, value] pairs")
                return {_hashable(decode_value(k, depth + 1)): decode_value(v, depth + 1) for k, v in pairs}
        if any(k.startswith("$") for k in value):
            raise ValueError(f"unknown tagged value {sorted(value)!r}")
        return {k: decode_value(v, depth + 1) for k, v in value.items()}
    if type(value) is float and not math.isfinite(value):
        raise ValueError("a non-finite float must be tagged {\"$float\": ...}")
    return value


def _as_list(body: Any, tag: str) -> list:
    if not isinstance(body, list):
        raise ValueError(f"{tag} must hold a list")
    return body


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, tuple)):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        raise ValueError("a $dict key cannot be an object")
    return key
