"""Crafted IR files for the load tests: a base qat IR (x -> relu -> y) holding the cases' operands as constants, and
its header rewritten with other nodes and resealed with a matching checksum, so that only load's header checks
can refuse it (tests/test_ir_load_arity.py, tests/test_ir_load_shapes.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import Module, save
from quantlens.compiler.ir import Graph, InputLeaf, Node, ValueInfo
from quantlens.compiler.serialize import CHECKSUM_KEY, METADATA_KEY, file_checksum


def save_base(constants: dict[str, torch.Tensor], path: Path) -> Path:
    """A saved qat IR (x [1, 4, 4, 4] -> relu -> y) whose constants are every case's operands."""
    values = {name: ValueInfo(tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in constants.items()}
    values["x"] = ValueInfo((1, 4, 4, 4), "float32")
    graph = Graph(nodes=[Node("relu", ["x"], ["y"], {}, "base.relu")], inputs=["x"], outputs=["y"],
                  constants=constants, values=values)
    in_spec = pytree.treespec_dumps(pytree.tree_flatten(((0,), {}))[1])
    out_spec = pytree.treespec_dumps(pytree.tree_flatten(0)[1])
    return save(Module("qat", graph, [InputLeaf("tensor", "x")], in_spec, out_spec, meta={}), path)


def craft(base: Path, path: Path, kind: str, nodes: list[tuple],
          values: Callable[[list[dict]], list[dict]] | None = None) -> Path:
    """``base`` with ``nodes`` (``(op, inputs, outputs, attrs)``, op site ``crafted.<op>``), the last node's first
    output as the graph output and ``values`` applied to the value infos (the base's ``y`` left out), resealed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(base), framework="pt") as handle:
        header = json.loads(handle.metadata()[METADATA_KEY])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    header["kind"] = kind
    header["nodes"] = [{"op": op, "inputs": ins, "outputs": outs, "attrs": attrs, "site": f"crafted.{op}"}
                       for op, ins, outs, attrs in nodes]
    header["outputs"] = [nodes[-1][2][0]]
    kept = [v for v in header["values"] if v["name"] != "y"]
    header["values"] = values(kept) if values is not None else kept
    text = json.dumps(header)
    save_file(tensors, str(path), metadata={METADATA_KEY: text, CHECKSUM_KEY: file_checksum(text, tensors)})
    return path
