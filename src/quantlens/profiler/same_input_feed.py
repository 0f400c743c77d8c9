"""What an IR site's same-input run is fed (see :mod:`.ir_access`): the baseline's value of each input, taken so that
the run adds nothing but the site's own arithmetic.

* **Index inputs** come from the baseline's *indices*. A site's outputs are not laid out alike on both sides: a
  ``topk`` whose values the model drops is one ``slice`` of the sort's indices in an IR (its output 0 is the
  indices), while the torch model's ``topk`` returns ``(values, indices)``. Taking the baseline's output at the same
  position fed a ``gather`` the scores as indices. An index input takes the baseline's index output of the same rank
  among the site's index outputs (and a value input the value output of the same rank).
* **A float input read through a ``dequantize``** (an op after the DeQuantStub: ``conv -> dequantize ->
  pixel_shuffle``) takes the baseline's float value as it is, in place of the dequantize's result. Quantizing the
  baseline's value onto the analysis' grid first (an int32 accumulator grid where the baseline holds the float
  result) charged the producer's output rounding to the op after the stub: a pure movement showed a loss.
"""

from __future__ import annotations

from typing import Callable

import torch

from quantlens.compiler.ir import Node

__all__ = ["is_index_value", "baseline_output", "float_heads"]


def is_index_value(info) -> bool:
    """Whether an IR value (its ``ValueInfo``) holds indices: an integer tensor on no quantization grid."""
    return info is not None and not info.qdtype and str(info.dtype).startswith(("int", "uint"))


def baseline_output(base: list[torch.Tensor], position: int, outputs: list[str],
                    is_index: Callable[[str], bool]) -> torch.Tensor | None:
    """The baseline's output feeding the analysis value ``outputs[position]`` of a site whose values are ``outputs``:
    the output of the same kind (indices or values) and the same rank among that kind (None: the baseline has
    none). Where the two sides lay the site's outputs out alike, this is ``base[position]``."""
    if position >= len(outputs):
        return base[position] if position < len(base) else None
    wanted = is_index(outputs[position])
    rank = sum(1 for name in outputs[:position] if is_index(name) == wanted)
    same_kind = [t for t in base if (not t.is_floating_point()) == wanted]
    if len(same_kind) == len(base):  # both sides' outputs are one kind: positions pair as they are
        return base[position] if position < len(base) else None
    return same_kind[rank] if rank < len(same_kind) else None


def float_heads(nodes: list[Node], positions: list[int], externals: list[str]) -> dict[str, int]:
    """External value -> the program position of the ``dequantize`` that alone reads it (a site's program starting
    at the DeQuantStub's boundary): its same-input run takes the baseline's float value in place of that node's
    result. None of a program's nodes is skipped when every one would be (a site that is the dequantize alone)."""
    heads: dict[str, int] = {}
    for name in externals:
        readers = [k for k, i in enumerate(positions) if name in nodes[i].inputs]
        if len(readers) == 1 and nodes[positions[readers[0]]].op == "dequantize" and \
                nodes[positions[readers[0]]].inputs[0] == name:
            heads[name] = readers[0]
    return heads if len(heads) < len(positions) else {}
