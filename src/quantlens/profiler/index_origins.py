"""Which op site made each index tensor of a traced forward.

An index (a gather's indices, an embedding's ids) is often made by float arithmetic at op sites (positions through
``log`` and ``ceil``, then a cast) and then moved by integer ops that are no op site (``clamp``, ``expand``, an
index of it): the tracer runs those without naming them. :class:`IndexOrigins` follows each integer tensor from the
op site that made it through such ops (by tensor identity, held weakly), so that the op reading it can name its
maker (``SiteEvent.index_producer``: the advisor's ``index_input_differs``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["IndexOrigins", "is_index_tensor"]


def is_index_tensor(value: Any) -> bool:
    """An integer tensor (indices, positions, ids); booleans are masks, not indices."""
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() and \
        value.dtype is not torch.bool


class IndexOrigins:
    """The op site that made each live index tensor of one forward."""

    def __init__(self):
        self._made: dict[int, tuple[weakref.ref, str]] = {}

    def remember(self, values: Any, site: str) -> None:
        """The index tensors among ``values`` (any structure) were made by op site ``site``."""
        for t in pytree.tree_leaves(values):
            if is_index_tensor(t):
                self._made[id(t)] = (weakref.ref(t), site)

    def origin(self, value: Any) -> str | None:
        """The op site that made ``value`` (None: a model input, a constant, or not an index)."""
        entry = self._made.get(id(value)) if is_index_tensor(value) else None
        return entry[1] if entry is not None and entry[0]() is value else None

    def follow(self, args: tuple, kwargs: dict, out: Any) -> None:
        """An op that is no op site (integer only: a clamp, an expand) made ``out`` from ``args``: its index
        tensors come from the site that made the first index input."""
        source = next((o for o in map(self.origin, pytree.tree_leaves((args, kwargs))) if o is not None), None)
        if source is not None:
            self.remember(out, source)
