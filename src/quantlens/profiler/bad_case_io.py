"""The bad case as ``QuantAnalysis`` takes it: refused when it holds nothing to analyse, read back from its file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from quantlens.errors import QuantLensError

__all__ = ["refuse_empty", "read_bad_case"]


def refuse_empty(data: Any) -> None:
    """A bad case whose every tensor is empty would give a report of zeros rather than an analysis."""
    from torch.utils import _pytree as pytree

    tensors = [t for t in pytree.tree_leaves(data) if isinstance(t, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:4])
        raise QuantLensError(f"set_bad_case(): every input tensor is empty ({shapes}); there is nothing to "
                             "analyse. Pass at least one sample (a batch of size >= 1).")


def read_bad_case(path: Path) -> Any:
    """The bad case saved at ``path`` by ``set_bad_case`` / ``auto_find_bad_case`` (tensors and containers only)."""
    if not path.is_file():
        raise QuantLensError(f"load_bad_case: {path} does not exist. Call auto_find_bad_case() or set_bad_case() "
                             "first, or pass the file's path.")
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise QuantLensError(f"load_bad_case: {path} holds objects other than tensors and containers ({exc}). "
                             "Pass the input to set_bad_case() directly.") from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError):
        # a truncated or overwritten file: torch says "PytorchStreamReader failed reading zip archive", an empty
        # one EOFError, another format KeyError / ValueError
        raise QuantLensError(
            f"load_bad_case: {path} is damaged ({_size(path)}: truncated, or not a bad case saved by quantlens). "
            "Save it again: run auto_find_bad_case(data) or set_bad_case(example_inputs) with this out_dir, or "
            "pass the path of an intact file.") from None


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes"
    except OSError:
        return "size unknown"
