"""What the torch and the IR ablation caches share: the memory budget of the cached values and the signal
that a cached value can no longer be trusted."""

from __future__ import annotations

import os

import torch

__all__ = ["CacheUnusable", "Budget", "default_max_bytes"]


def default_max_bytes() -> int:
    """The cache's memory budget: ``QUANTLENS_SENSITIVITY_CACHE_MB`` MiB (default 1 GiB)."""
    return int(float(os.environ.get("QUANTLENS_SENSITIVITY_CACHE_MB", "1024")) * (1 << 20))


class CacheUnusable(Exception):
    """A cached value was changed by the model during an ablation: rerun it as a full forward."""


class Budget:
    """The bytes the cached values may still take; storages shared by views count once."""

    def __init__(self, max_bytes: int):
        self.left = max_bytes
        self.seen: set[int] = set()

    def take(self, tensors: list[torch.Tensor]) -> bool:
        """Charge the storages of ``tensors`` not charged yet; False (nothing charged) when they do not fit."""
        new = {}
        for t in tensors:
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                return False
            if ptr not in self.seen:
                new[ptr] = storage.nbytes()
        need = sum(new.values())
        if need > self.left:
            return False
        self.left -= need
        self.seen.update(new)
        return True
