"""The progress file: every measurement of a search, keyed by a fingerprint of its inputs, so that a search
started again with the same inputs replays it and continues (``out_dir/mixed_precision_progress.json``)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from quantlens.errors import QuantLensWarning
from quantlens.search.promotion import Promotion

__all__ = ["PROGRESS_FILE", "Progress", "fingerprint", "selection_key"]

PROGRESS_FILE = "mixed_precision_progress.json"
_FORMAT = 1


def _hash_tree(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k!s}".encode())
            _hash_tree(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for item in obj:
            _hash_tree(h, item)
    else:
        h.update(repr(obj).encode())


def fingerprint(model: nn.Module, example_inputs, batches, candidates, ranking, target, budget, tries,
                base_name: str, higher_is_better: bool, method: str = "greedy", prune: bool = True,
                exchange: int = 0) -> str:
    """What the chosen promotions depend on (not ``latency``: the latency estimates only annotate the curve)."""
    h = hashlib.sha256()
    _hash_tree(h, dict(model.state_dict()))
    _hash_tree(h, example_inputs)
    _hash_tree(h, list(batches))
    h.update(json.dumps({"candidates": [asdict(c) for c in candidates], "ranking": [asdict(c) for c in ranking],
                         "target": float(target), "budget": repr(budget), "tries": tries, "base": base_name,
                         "higher": higher_is_better, "method": method, "prune": prune,
                         # absent when off, so that files written before the exchange existed still resume
                         **({"exchange": exchange} if exchange else {})}, sort_keys=True).encode())
    return h.hexdigest()


def selection_key(selection: Iterable[Promotion]) -> str:
    """A configuration's key in the progress file (the same for any order of the same promotions)."""
    return ";".join(f"{p.site}|{p.kind}" for p in sorted(selection))


class Progress:
    """The progress file's data (``measurements``, ``latency``, ``steps``, ``ranking``, ``done``), loaded from
    ``path`` when ``resume`` and it was written with the same ``fingerprint``; :meth:`save` writes it."""

    def __init__(self, path: Path, fingerprint: str, resume: bool):
        self.path = path
        self.data = {"format": _FORMAT, "fingerprint": fingerprint, "measurements": {}, "latency": {},
                     "steps": [], "done": False}
        if resume and path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError):
                old = None
            if old and old.get("format") == _FORMAT and old.get("fingerprint") == fingerprint:
                self.data = old
            elif old is not None:
                # stacklevel 3: the caller of search_mixed_precision, which constructs this
                warnings.warn(f"{path}: written by a search with other inputs (model, data, candidates, target or "
                              "budget); starting afresh.", stacklevel=3, category=QuantLensWarning)
        self.resumed_measurements = len(self.data["measurements"])

    def save(self) -> None:
        """Write the data atomically (a crash leaves the previous file)."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
