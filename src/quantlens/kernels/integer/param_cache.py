"""The integer kernels' caches of prepared parameters, keyed on what a node-free call has.

* :func:`prepared`: a value made from a call's ``attrs`` dict (requantize multipliers as tensors, a table op's
  schema split, ...), kept per dict object (by identity) while the dict stays equal to the snapshot it was made
  from. A quantized IR node passes its own ``attrs`` on every run, so its parameters are made once; a call that
  builds a fresh dict (the emulator) makes them again. A dict cannot be weakly referenced: the cache holds each
  dict it keys on (so its identity cannot be reused while the entry lives) and, when it has grown, drops the
  entries whose dict only the cache still holds (:func:`_sweep`, amortized over the insertions).
* :class:`TensorCache`: values made from a constant tensor (a GEMM's weight prepared for the GEMM), weakly keyed
  on the tensor: an entry goes with its tensor.
"""

from __future__ import annotations

import copy
import sys
import weakref
from typing import Any, Callable

__all__ = ["prepared", "TensorCache"]


class _Slot:
    __slots__ = ("attrs", "snapshot", "values")

    def __init__(self, attrs: dict, snapshot: dict, values: dict):
        self.attrs, self.snapshot, self.values = attrs, snapshot, values


#: id(attrs) -> the attrs dict (held), a snapshot of it, and the values built from it (by builder)
_SLOTS: dict[int, _Slot] = {}
_MIN_SWEEP = 1024
_sweep_at = _MIN_SWEEP
_MISSING = object()


def _count_of_a_slot_only_dict() -> int:
    """``sys.getrefcount(slot.attrs)`` of a dict only a slot holds (what the interpreter counts for the call)."""
    probe = _Slot({}, {}, {})
    return sys.getrefcount(probe.attrs)


_ONLY_THE_CACHE = _count_of_a_slot_only_dict()


def _sweep() -> None:
    """Drop the entries whose attrs dict nobody but the cache holds."""
    global _sweep_at
    for key, slot in list(_SLOTS.items()):
        if sys.getrefcount(slot.attrs) <= _ONLY_THE_CACHE and _SLOTS.get(key) is slot:
            _SLOTS.pop(key, None)
    _sweep_at = max(_MIN_SWEEP, 2 * len(_SLOTS))


def prepared(attrs: dict, build: Callable[[dict], Any]) -> Any:
    """``build(attrs)``, cached per attrs dict (by identity) while it stays equal to the one it was built from.
    ``build`` must not keep ``attrs`` itself (copies of its entries are fine): the cache could not drop it."""
    key = id(attrs)
    slot = _SLOTS.get(key)
    if slot is not None:
        try:
            fresh = slot.attrs is attrs and slot.snapshot == attrs
        except Exception:  # attrs that do not compare (tensors): no caching
            fresh = False
        if fresh:
            value = slot.values.get(build, _MISSING)
            if value is _MISSING:
                value = slot.values[build] = build(attrs)
            return value
        _SLOTS.pop(key, None)
    value = build(attrs)
    try:
        snapshot = copy.deepcopy(attrs)
    except Exception:
        return value
    if len(_SLOTS) >= _sweep_at:
        _sweep()
    _SLOTS[key] = _Slot(attrs, snapshot, {build: value})
    return value


class TensorCache:
    """Values keyed on a tensor (weakly, by identity) and a hashable ``extra`` key; an entry is dropped when its
    tensor is freed. The caller checks that a value still fits (the tensor's ``_version``, ...)."""

    def __init__(self):
        #: (id(tensor), extra) -> (weakref to the tensor, value)
        self._entries: dict[tuple[int, Any], tuple[weakref.ref, Any]] = {}

    def get(self, tensor, extra: Any = None) -> Any:
        entry = self._entries.get((id(tensor), extra))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return None

    def put(self, tensor, extra: Any, value: Any) -> Any:
        key = (id(tensor), extra)
        entries = self._entries

        def forget(ref: weakref.ref, key=key) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(tensor, forget), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
