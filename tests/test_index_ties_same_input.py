"""Index ops at ties, and the same-input runs of the ops that read indices (issue #42).

A detection head: int8 scores (many equal: a feature that takes 4 values), ``topk`` of them, then a ``gather`` of
the boxes by the indices; and an ``argsort`` of the same scores.

* Ties: the march puts the lower index first (docs/march.md §11.1), as onnxruntime's TopK does; every stage's
  indices equal onnxruntime's (before, the prepared model's ``argsort`` kept torch's order: 6 % equal).
* A ``gather`` only moves values: on the baseline's inputs, indices included, it is exact. Before, the torch
  models' same-input runs fed it their own indices (the float vs fake-quant pair: 8.5 dB, the int8 ties picking
  other boxes), and the qat IR's fed it the baseline's ``topk`` *values* as indices (a ``topk`` whose values the
  model drops is a ``slice`` of the sort's indices in the IR: its output 0; 11.6 dB).
* An op after the DeQuantStub (``conv -> dequantize -> pixel_shuffle`` in the quantized IR) is fed the baseline's
  float value itself, not that value rounded onto the conv's int32 grid and dequantized (the conv's own rounding
  showed as the movement op's loss, 139.5 dB instead of exact).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

K = 10


class DetectionHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.score, self.box = nn.Linear(8, 1), nn.Linear(8, 4)

    def forward(self, x):  # x: (n, anchors, 8)
        x = self.q(x)
        scores = self.score(x).squeeze(-1)
        boxes = torch.sigmoid(self.box(x))  # int8 boxes
        _, idx = torch.topk(scores, K, dim=1)
        picked = torch.gather(boxes, 1, idx.unsqueeze(-1).expand(-1, -1, 4))
        return self.dq(picked), idx, torch.argsort(scores, dim=1, descending=True)


def _anchors(seed: int) -> tuple[torch.Tensor]:
    """Scores from feature 0 alone: 4 levels plus a little noise, so the int8 scores tie and the float ones do not."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, 8, generator=g)
    x[..., 0] = torch.randint(0, 4, (2, 40), generator=g).float() + 0.003 * torch.randn(2, 40, generator=g)
    return (x,)


@pytest.fixture(scope="module")
def stages():
    torch.manual_seed(0)
    model = DetectionHead().eval()
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1.0
        model.score.bias.zero_()
    example = _anchors(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None),
                          [example, _anchors(2)])
        pe = pre_export(calib, example_inputs=example)
        qat_ir = export(pe, example)
    return {"float": model, "calibration": calib, "pre_export": pe, "qat IR": qat_ir, "quantized IR": convert(qat_ir)}


def test_indices_at_ties_equal_onnxruntimes_at_every_stage(stages, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = to_onnx(stages["qat IR"], tmp_path / "head.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = _anchors(3)[0]
    _, top_ort, order_ort = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for name in ("calibration", "pre_export", "qat IR", "quantized IR"):
        _, top, order = stages[name](x)
        assert np.array_equal(top.numpy(), top_ort), name
        assert np.array_equal(order.numpy(), order_ort), name
    # tie-heavy: on the scores' codes torch's own topk (the float model as its author runs it) orders ties otherwise
    codes = torch.round(x[..., 0] / (x[..., 0].abs().max() / 127))
    assert len(torch.unique(codes)) <= 8
    assert not torch.equal(torch.topk(codes, K, dim=1).indices, torch.from_numpy(top_ort))


def _rows(baseline, analysis, kind, example, out_dir):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    qa.run()
    return {r.op_name: r for r in qa.compare_per_layer()}


@pytest.mark.parametrize("pair", [("float", "calibration", "fake_quant"), ("pre_export", "qat IR", "export")])
def test_gather_on_the_same_input_takes_the_baselines_indices(stages, tmp_path, pair):
    baseline, analysis, kind = pair
    rows = _rows(stages[baseline], stages[analysis], kind, _anchors(3), tmp_path)
    gather = rows["gather_0"]
    assert gather.same_input_sqnr == math.inf, (gather.same_input_sqnr, gather.note)
    assert gather.same_input_lsb_verdict in ("", "bit-exact")
    if kind == "fake_quant":  # the int8 ties pick other boxes than the float scores: the accumulated error is there
        assert gather.Cosine < 0.99


class AfterTheStub(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq, self.conv = QuantStub(), DeQuantStub(), nn.Conv2d(3, 12, 3, padding=1)

    def forward(self, x):  # the conv feeds the DeQuantStub alone: an int32 output, dequantized, then a movement
        return torch.pixel_shuffle(self.dq(self.conv(self.q(x))), 2)


def test_a_movement_after_the_dequant_stub_is_exact_on_the_same_input(tmp_path):
    torch.manual_seed(0)
    example = (torch.randn(2, 3, 6, 6),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(prepare(AfterTheStub().eval(), example, default_calibration_qconfig_setter,
                                  check_result_dir=None), [example, (torch.randn(2, 3, 6, 6),)])
        qat_ir = export(pre_export(calib, example_inputs=example), example)
    quantized = convert(qat_ir)
    assert [n.op for n in quantized.graph.nodes][-2:] == ["dequantize", "pixel_shuffle"]
    rows = _rows(qat_ir, quantized, "convert", example, tmp_path)
    assert rows["conv"].quant_dtype == "qint32" and rows["conv"].same_input_sqnr < math.inf  # the conv's own rounding
    shuffle = rows["pixel_shuffle_0"]
    assert shuffle.quant_dtype == "float" and shuffle.same_input_sqnr == math.inf, shuffle.same_input_sqnr
    assert shuffle.note == ""
