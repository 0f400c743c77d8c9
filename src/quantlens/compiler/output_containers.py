"""Output containers of third-party libraries that torch's pytree does not know by itself.

A model may return an object of its library's own type that holds tensors: transformers' ``DynamicCache`` (GPT-2's
``past_key_values`` with ``use_cache=True``). The IR records its outputs as a pytree, so such a type must be a
pytree node, flattened and rebuilt the way its library defines for ``torch.export``. ``OUTPUT_CONTAINERS`` maps the
type's qualified name to a function that registers it through the library's own export support; it is called when
an export meets such an output, and when an IR whose output structure names the type is read or run.
"""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from quantlens._registry import make_registry

__all__ = ["OUTPUT_CONTAINERS", "output_container", "register_containers_of", "load_spec"]

#: the qualified name of an output type -> a function registering it as a pytree node (its library's own way)
OUTPUT_CONTAINERS, output_container = make_registry("output container")
_done: set[str] = set()


@output_container("transformers.cache_utils.DynamicCache")
def _transformers_dynamic_cache() -> None:
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()  # (it accepts being called twice)


def _qualified(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def register_lowering(name: str) -> None:
    if name in OUTPUT_CONTAINERS and name not in _done:
        OUTPUT_CONTAINERS[name]()
        _done.add(name)


def register_containers_of(output: Any) -> bool:
    """Register every known container type among the leaves of ``output``; whether any was new."""
    names = {_qualified(leaf) for leaf in pytree.tree_leaves(output)} & set(OUTPUT_CONTAINERS)
    fresh = names - _done
    for name in sorted(fresh):
        register_lowering(name)
    return bool(fresh)


def load_spec(text: str) -> pytree.TreeSpec:
    """``pytree.treespec_loads(text)``, with the container types the text names registered first."""
    for name in OUTPUT_CONTAINERS:
        if name in text:
            register_lowering(name)
    return pytree.treespec_loads(text)
