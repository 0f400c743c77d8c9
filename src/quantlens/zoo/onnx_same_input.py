"""The onnxruntime pair's per-op criterion (docs/coverage.md): each op of the ONNX model run by onnxruntime, at its
default options, on the qat IR's own inputs, in output steps of the op's grid.

The ONNX model is cut at every activation fake quant: each consumer of a fake quant's output reads a new graph input
instead (``cut/<value>``), fed with the qat IR's value, and every such output becomes a graph output. One run then
computes every stretch between two fake quants (an op with its rounding) from the same input as the qat IR, which is
the profiler's same-input run for the convert pair. onnxruntime still optimizes inside each stretch (a conv with its
bias and ReLU), so its own kernels and fusions are what is measured; only fusions across a fake quant are lost, and
the exact QDQ form quantlens writes has none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["worst_onnx_same_input_step"]

_CUT = "cut/"


def worst_onnx_same_input_step(qat_ir, path: Path, inputs: Any) -> float:
    """The largest error of any stretch of the ONNX model at ``path`` (written from ``qat_ir`` by ``to_onnx``) against
    ``qat_ir`` on the qat IR's own inputs of that stretch, in units of its output fake quant's step."""
    import onnx
    import onnxruntime as ort

    args = inputs if isinstance(inputs, tuple) else (inputs,)
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    feeds = dict(zip(qat_ir.graph.inputs, tensors))
    env: dict[str, torch.Tensor] = {}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        qat_ir.run(feeds, observer=lambda node, ins, outs: env.update(zip(node.outputs, outs)))
    steps = _activation_steps(qat_ir)
    proto = onnx.load(str(path))
    produced = {o for node in proto.graph.node for o in node.output}
    cuts = sorted(v for v in steps if v in produced and v in env)
    if not cuts:
        return 0.0
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in steps and name in cuts:
                node.input[i] = _CUT + name
    del proto.graph.output[:]
    for v in cuts:
        proto.graph.input.append(onnx.helper.make_tensor_value_info(_CUT + v, onnx.TensorProto.FLOAT, None))
        proto.graph.output.append(onnx.helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()  # onnxruntime's default options (ORT_ENABLE_ALL)
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    run_feeds = {name: t.numpy() for name, t in feeds.items() if name in wanted}
    run_feeds.update({_CUT + v: env[v].detach().float().numpy() for v in cuts if _CUT + v in wanted})
    outs = session.run(cuts, run_feeds)
    worst = 0.0
    for v, got in zip(cuts, outs):
        diff = (torch.from_numpy(got).float() - env[v].float()).abs().max().item() if got.size else 0.0
        worst = max(worst, diff / steps[v])
    return worst


def _activation_steps(qat_ir) -> dict[str, float]:
    """Each per-tensor activation fake quant's output value -> its step (weights are constants, not stretches)."""
    constants = qat_ir.graph.constants
    out = {}
    for node in qat_ir.graph.nodes:
        if node.op == "fake_quant" and node.inputs[0] not in constants and node.inputs[1] in constants:
            scale = constants[node.inputs[1]]
            if scale.numel() == 1 and float(scale) > 0:
                out[node.outputs[0]] = float(scale)
    return out
