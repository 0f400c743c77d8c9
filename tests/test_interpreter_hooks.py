"""The interpreter's public hooks (observation, kernel override, output substitution, run_nodes) and the
quantized IR's output_site attribution: what the profiler of the deployed stages is built on."""

import warnings

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.compiler.interpreter import RunHooks, run_nodes
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.flatten(1)))


def _irs():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = calibrate(prepare(_Net(), x, default_calibration_qconfig_setter, check_result_dir=None), [x])
    qat = export(pre_export(model), x)
    return x, qat, convert(qat)


def test_override_replaces_a_kernel_and_substitute_replaces_outputs():
    x, qat, _ = _irs()
    feeds = {qat.input_names[0]: x}
    reference = qat.run(feeds)[0]
    ran = []
    conv = next(n for n in qat.graph.nodes if n.op == "conv2d")

    def override(node, inputs):
        if node is conv:
            ran.append(node.op)
            return torch.zeros(2, 3, 4, 4)  # the conv does not run: its output is all zeros
        return None

    zeroed = qat.run(feeds, hooks=RunHooks(override=override))[0]
    assert ran == ["conv2d"]
    assert not torch.equal(zeroed, reference)
    fc = next(n for n in qat.graph.nodes if n.op == "linear")
    seen = []
    substituted = qat.run(feeds, hooks=RunHooks(
        observer=lambda node, inputs, outs: seen.append(node.op),
        substitute=lambda node, inputs, outs: [outs[0] * 0] if node is fc else None))[0]
    assert torch.equal(substituted, torch.zeros_like(reference))  # the substituted value is what follows
    assert seen == [n.op for n in qat.graph.nodes]


def test_run_nodes_evaluates_a_part_of_the_graph():
    x, qat, _ = _irs()
    values = {}
    qat.run({qat.input_names[0]: x}, observer=lambda node, inputs, outs: values.update(zip(node.outputs, outs)))
    linear = next(n for n in qat.graph.nodes if n.op == "linear")
    env = {name: values[name] for name in linear.inputs if name in values}
    out = run_nodes(qat, [linear], env)
    assert torch.equal(out[linear.outputs[0]], values[linear.outputs[0]])


def test_integer_ops_name_the_fused_site_whose_grid_they_requantize_to():
    _, qat, quantized = _irs()
    conv = next(n for n in quantized.graph.nodes if n.op == "conv2d")
    # conv -> bn (folded at prepare) -> relu: the integer conv requantizes straight to the relu's grid
    relu_fq = next(n for n in qat.graph.nodes if n.op == "fake_quant" and n.site.startswith("relu"))
    assert conv.site == "conv" and conv.attrs["output_site"] == relu_fq.site
    for name, info in quantized.graph.values.items():  # every integer value names its scale
        assert not info.qdtype or info.scale in quantized.graph.constants, name
