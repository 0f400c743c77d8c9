"""``make_registry``: the one way quantlens declares an extension point (an op's converter, kernel, emulation
rule, ONNX mapping, advisor rule...).

A registry is a plain dict from a key (an op name, a rule name) to a function, and a decorator that adds the
decorated function under one or more keys. Registering a key twice is an error: two modules that both claim an op
would otherwise depend on import order to decide which wins.

    CONVERTERS, converter = make_registry("convert converter")

    @converter("add", "sub")
    def _add(c, node): ...
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["make_registry"]


def make_registry(what: str, table: dict | None = None,
                  replace: bool = False) -> tuple[dict, Callable[..., Callable[[F], F]]]:
    """``(table, register)``: ``@register(key, ...)`` adds the decorated function to ``table`` under each key (in
    registration order) and returns it unchanged. ``what`` names the registry in the error for a repeated key.

    ``table``: fill an existing dict (a merged view, a public table) instead of a new one. ``replace``: a public
    extension point where a user's function may replace a built-in one on purpose (an ONNX converter, an advisor
    rule); the built-in registries keep it off, so two modules claiming one key fail at import."""
    table = {} if table is None else table

    def register(*keys: Hashable) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for key in keys:
                if key in table and not replace:
                    raise ValueError(f"{what} {key!r} is registered twice ({table[key].__module__}."
                                     f"{table[key].__qualname__} and {fn.__module__}.{fn.__qualname__}).")
                table[key] = fn
            return fn

        return add

    return table, register
