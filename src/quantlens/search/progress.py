"""The progress file: every measurement of a search, keyed by a fingerprint of its inputs, so that a search
started again with the same inputs replays it and continues (``out_dir/mixed_precision_progress.json``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from quantlens._io import atomic_write_text
from quantlens.search.progress_file import is_number_map, read_progress
from quantlens.search.promotion import Promotion
from quantlens.search.provenance import hash_tree, model_code_identity

__all__ = ["PROGRESS_FILE", "Progress", "fingerprint", "selection_key"]

PROGRESS_FILE = "mixed_precision_progress.json"
_FORMAT = 1


def _ranking_problem(ranking: Any) -> str | None:
    if ranking is None:
        return None
    if not isinstance(ranking, list) or not all(
            isinstance(p, dict) and set(p) == {"site", "kind"} and isinstance(p["site"], str)
            and p["kind"] in ("activation", "weight") for p in ranking):
        return "'ranking' is not a list of {site, kind} promotions"
    return None


def _problem(data: dict) -> str | None:
    """What is wrong with a progress file's fields (None: nothing), so that a damaged file is set aside rather
    than replayed into an error halfway through the search."""
    if not is_number_map(data.get("measurements")):
        return "'measurements' does not map configurations to finite numbers"
    if not is_number_map(data.get("latency"), int):
        return "'latency' does not map configurations to whole numbers of cycles"
    if not isinstance(data.get("steps"), list) or not all(isinstance(s, dict) for s in data["steps"]):
        return "'steps' is not a list of objects"
    if not isinstance(data.get("done"), bool):
        return "'done' is not true or false"
    return _ranking_problem(data.get("ranking"))


def fingerprint(model: nn.Module, example_inputs, batches, candidates, ranking, target, budget, tries,
                base_name: str, higher_is_better: bool, method: str = "greedy", prune: bool = True,
                exchange: int = 0, evaluation: str = "") -> str:
    """What the chosen promotions depend on (not ``latency``: the latency estimates only annotate the curve);
    ``evaluation``: what decides ``evaluate``'s value (:func:`~quantlens.search.provenance.evaluate_identity` and
    the caller's ``evaluation_key``)."""
    h = hashlib.sha256()
    hash_tree(h, dict(model.state_dict()))
    hash_tree(h, example_inputs)
    hash_tree(h, list(batches))
    h.update(json.dumps({"evaluation": evaluation, "code": model_code_identity(model),"candidates": [asdict(c) for c in candidates], "ranking": [asdict(c) for c in ranking],
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
    ``path`` when ``resume`` and it was written with the same ``fingerprint`` (a damaged file is set aside,
    :func:`~quantlens.search.progress_file.read_progress`); :meth:`save` writes it."""

    def __init__(self, path: Path, fingerprint: str, resume: bool):
        self.path = path
        self.data = {"format": _FORMAT, "fingerprint": fingerprint, "measurements": {}, "latency": {},
                     "steps": [], "done": False}
        if resume:
            # stacklevel 3: the caller of search_mixed_precision, which constructs this
            old = read_progress(path, fingerprint, _FORMAT, _problem, stacklevel=3)
            if old is not None:
                self.data = old
        self.resumed_measurements = len(self.data["measurements"])

    def save(self) -> None:
        """Write the data atomically (a crash leaves the previous file)."""
        atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True))
