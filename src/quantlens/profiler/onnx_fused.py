"""The ``onnxruntime`` pair of a ``March.ORT_CPU`` quantized IR: the session's values op site by op site, at the
runtime's default level, without blocking a fusion (``docs/march_ort.md``).

An extra graph output blocks the runtime's Q/DQ fusions, so the values are not fetched from the written file: the
runtime's own optimized graph (its fused int8 kernels, float ops, layout changes) is saved once, every value the
quantized IR's op sites stand for is added to it as an output, and that graph runs with its optimizations off: the
very kernels of a default session.

* **Sites.** A site whose last IR node is a runtime kernel (attr ``runtime``) is that kernel in the runtime's graph
  (same op site and kernel, in order); any other site is the last node the runtime runs for it (nodes are named
  ``<op site>/<op>/<index>``). A site the runtime computes in no node of its own (data movement it folded, a
  quantize pair it removed) is not traced.
* **Values.** The runtime's codes less their zero point are the IR's codes (an int8 activation is uint8 + 128 in the
  runtime); a value the runtime holds channels last is moved back to channels first.
* **Same input.** A fused kernel is re-run alone (a one-node graph of the runtime's node, its constants) on the
  quantized IR's own inputs to that node: the kernel rule itself, bit for bit. A float op or data movement has no
  same-input output (the note says so).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlens.compiler.onnx.runtime_kernels import site_of
from quantlens.compiler.onnx.runtime_match import (
    ZERO_POINT_INPUT,
    activation_inputs,
    channels_last_values,
    in_ir_layout,
    in_runtime_layout,
    kernel_of,
    reads_channels_last,
)

__all__ = ["FusedGraph", "FLOAT_NOTE"]

#: the same-input note of a site the runtime computes in float (or by moving codes)
FLOAT_NOTE = ("onnxruntime computes this op site in float or moves its codes (no fused kernel): only its fused int8 "
              "kernels are re-run alone on the baseline's inputs")


@dataclass
class _Site:
    """Where an IR op site's value is in the runtime's graph."""

    node: Any  # the runtime's NodeProto
    fused: bool
    activations: list[int] = field(default_factory=list)  # the runtime node's activation input positions
    ir_index: int = -1  # the IR node whose value the runtime node computes (the site's last, or the kernel before
    # a ReLU the runtime dropped)
    output: str = ""  # the runtime's value for it (a fused kernel's output, or the one named as the qat IR names it)

    def __post_init__(self):
        self.output = self.output or self.node.output[0]


def _split_output(ref, node, runtime_node) -> str:
    """The output of a runtime Split that stands for the IR's ``slice`` ``node``: the runtime fuses the slices of
    one input along one dim into a Split (its GatherSliceToSplitFusion) whose outputs follow their starts."""
    if runtime_node.op_type != "Split" or node.op != "slice" or len(runtime_node.output) < 2:
        return ""
    siblings = sorted((int(n.attrs.get("start") or 0), id(n)) for n in ref.nodes
                      if n.op == "slice" and n.inputs[:1] == node.inputs[:1] and n.attrs.get("dim") == node.attrs.get("dim"))
    position = [i for i, (_, ident) in enumerate(siblings) if ident == id(node)]
    return runtime_node.output[position[0]] if position and position[0] < len(runtime_node.output) else ""


class FusedGraph:
    """The runtime's optimized graph of one ONNX file, with the IR op sites mapped onto its nodes."""

    def __init__(self, proto, reference, threads: int = 0):
        import onnx
        import onnxruntime as ort

        self._onnx, self._ort, self.threads = onnx, ort, threads
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "optimized.onnx"
            options = ort.SessionOptions()
            options.optimized_model_filepath = str(path)
            options.log_severity_level = 3
            ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
            self.proto = onnx.load(str(path))
        graph = self.proto.graph
        self.constants = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.channels_last = channels_last_values(list(graph.node))
        self.sites = self._map_sites(reference)
        self._session = None
        self._alone: dict[str, Any] = {}

    # -- the map ---------------------------------------------------------------------------------------------
    def _map_sites(self, ref) -> dict[str, _Site]:
        by_site: dict[str, list] = {}
        for node in self.proto.graph.node:
            if site_of(node.name) and node.output and node.output[0]:
                by_site.setdefault(site_of(node.name), []).append(node)
        made_by = {out: i for i, n in enumerate(ref.nodes) for out in n.outputs}
        found = {}
        for site in ref.sites:
            index = ref.last[site]
            if not by_site.get(site) and ref.nodes[index].op == "relu":  # a ReLU the runtime dropped into the kernel
                index = made_by.get(ref.nodes[index].inputs[0], index)  # before it (its clamp did the ReLU)
            node = ref.nodes[index]
            kernel = kernel_of(node)
            if kernel:  # the runtime names a fused kernel after the IR node's own site (a conv's, not its ReLU's)
                occurrence = sum(1 for n in ref.nodes[:index] if n.site == node.site and kernel_of(n) == kernel)
                same = [n for n in by_site.get(node.site, []) if n.op_type == kernel]
                if occurrence < len(same):
                    found[site] = _Site(same[occurrence], True, list(activation_inputs(same[occurrence])), index)
                continue
            # a value the runtime kept under the qat IR's name (the quantized IR's names are those + "_q<n>"): the
            # one to read, where one node has several outputs (a Split the runtime made of three Slices)
            named = re.sub(r"_q\d+$", "", node.outputs[0])
            if named in self.producer:
                found[site] = _Site(self.producer[named], False, [], index, named)
            elif by_site.get(site):
                last = by_site[site][-1]
                found[site] = _Site(last, False, [], index, _split_output(ref, node, last))
        return found

    # -- running ---------------------------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The values ``names`` (graph outputs and traced values) of one run of the optimized graph."""
        if self._session is None:
            proto = self._onnx.ModelProto()
            proto.CopyFrom(self.proto)
            have = {o.name for o in proto.graph.output}
            for site in self.sites.values():
                for name in [site.output, *(site.node.input[i] for i in site.activations)]:
                    if name not in have and name not in self.constants:
                        proto.graph.output.append(self._onnx.ValueInfoProto(name=name))
                        have.add(name)
            self._session = self._plain_session(proto)
        wanted = [o.name for o in self._session.get_outputs()]
        return dict(zip(wanted, self._session.run(wanted, feeds)))

    def _plain_session(self, proto):
        options = self._ort.SessionOptions()
        options.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # already optimized
        options.log_severity_level = 3
        if self.threads > 0:
            options.intra_op_num_threads = self.threads
        return self._ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def zero_point(self, name: str, values: dict) -> int:
        """The runtime's zero point of integer value ``name``: its quantize's or kernel's output zero point, through
        the ops that move codes."""
        seen = 0
        while name in self.producer and seen < 64:
            node = self.producer[name]
            index = ZERO_POINT_INPUT.get(node.op_type)
            if node.op_type == "QuantizeLinear":
                index = 2
            if index is not None:
                if index >= len(node.input) or not node.input[index]:
                    return 0
                zp = node.input[index]
                return int(np.asarray(self.constants[zp] if zp in self.constants else values[zp]).reshape(-1)[0])
            name, seen = node.input[0], seen + 1
        return 0

    def as_ir(self, name: str, value: np.ndarray, values: dict, like: torch.Tensor) -> torch.Tensor:
        """The runtime's value ``name`` as the IR holds it (``like``: the IR's tensor): codes less the zero point in
        the IR's storage type, channels first, the IR's shape."""
        t = torch.from_numpy(np.array(value))
        if not t.is_floating_point() and not like.is_floating_point():
            t = (t.to(torch.int32) - self.zero_point(name, values)).to(like.dtype)
        return in_ir_layout(t, tuple(like.shape), name in self.channels_last)

    def same_input(self, site: _Site, ir_node, ir_inputs: list, values: dict, constants: dict) -> torch.Tensor:
        """The runtime's fused kernel of ``site`` re-run alone on the IR's inputs to its node ``ir_node`` (``constants``:
        the IR's, whose inputs are the kernel's constants)."""
        node = site.node
        session = self._alone.get(node.name)
        if session is None:
            session = self._alone[node.name] = self._plain_session(self._one_node(node, site.activations, values))
        feeds = {}
        activations = [i for i, v in enumerate(ir_node.inputs) if v and v not in constants]
        zero_points = ir_node.attrs["zero_points"]
        for slot, index in ((slot, site.activations[slot]) for slot in activations if slot < len(site.activations)):
            name = node.input[index]
            runtime = np.asarray(values[name])
            codes = ir_inputs[slot].to(torch.int32) + int(zero_points[slot])
            nhwc = reads_channels_last(node) or name in self.channels_last
            codes = in_runtime_layout(codes, tuple(runtime.shape), nhwc)
            feeds[name] = codes.numpy().astype(runtime.dtype)
        return torch.from_numpy(np.array(session.run([node.output[0]], feeds)[0]))

    def _one_node(self, node, activations: list[int], values: dict):
        """A graph of the runtime's ``node`` alone: its activation inputs are the graph's inputs (types from this
        run's values), its constants the graph's initializers."""
        helper = self._onnx.helper

        def info(name: str):
            return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(values[name]).dtype),
                                                 None)

        inputs = [info(node.input[i]) for i in activations]
        used = {name for name in node.input if name in self.constants}
        initializers = [t for t in self.proto.graph.initializer if t.name in used]
        out = info(node.output[0])
        graph = helper.make_graph([node], "one_kernel", inputs, [out], initializer=initializers)
        model = helper.make_model(graph, opset_imports=list(self.proto.opset_import))
        model.ir_version = self.proto.ir_version
        return model


