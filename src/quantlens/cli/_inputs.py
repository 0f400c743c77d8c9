"""Inputs for commands that get only IR files: a saved bad case, or seeded random tensors by input name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantlens.cli.exits import UsageError

__all__ = ["add_input_options", "samples_for"]


def add_input_options(p) -> None:
    p.add_argument("--input", metavar="FILE.pt", default=None,
                   help="one call's inputs saved with torch.save (e.g. a QuantAnalysis badcase.pt); default: "
                   "seeded random tensors shaped like the IR's inputs, uniform in [-1, 1]")
    p.add_argument("--samples", type=int, default=4, help="random samples searched for the bad case (default 4)")
    p.add_argument("--batch", type=int, default=1, help="batch size of random samples for a dynamic batch "
                   "(default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random samples (default 0)")


def _random(module, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    feeds = {}
    for name in module.graph.inputs:
        info = module.graph.values.get(name)
        if info is None:
            raise UsageError(f"the IR does not record the type of input {name!r}: pass --input FILE.pt.")
        shape = [batch if d == -1 else d for d in info.shape]
        dtype = getattr(torch, info.dtype)
        if dtype.is_floating_point:
            feeds[name] = (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)
        else:
            feeds[name] = torch.zeros(shape, dtype=dtype)
    return feeds


def samples_for(module, args) -> list[Any]:
    """The candidate bad cases: the ``--input`` file, or ``--samples`` random feeds (a dict by input name)."""
    if args.input:
        path = Path(args.input)
        if not path.is_file():
            raise UsageError(f"--input {args.input!r} does not exist.")
        try:
            return [torch.load(path, weights_only=True)]
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"--input {args.input!r} is not a tensor file torch.load can read: {exc}") from None
    if args.samples < 1 or args.batch < 1:
        raise UsageError("--samples and --batch must be at least 1.")
    gen = torch.Generator().manual_seed(args.seed)
    return [_random(module, args.batch, gen) for _ in range(args.samples)]
