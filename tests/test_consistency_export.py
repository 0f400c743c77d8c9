"""What each deployed stage computes at every consistency level, and what the profiler's export and convert pairs
compare it with (docs/consistency.md, "What export and convert compute").

At levels 1-4 the prepared model's forward computes the march's integer rules and the quantized IR equals it bit for
bit; the qat IR is float + fake quant at every level (export traces the forward with the rules off), so it equals
the prepared model run without them (``without_integer_rules``). The ``export`` pair therefore runs its pre_export
baseline without the rules (bit-exact, no lowering finding), and the ``convert`` pair on a qat IR baseline does not
report the level's own rules as faults (no level-4 advice, no "bug")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    ConsistencyStrategy,
    DeQuantStub,
    FakeQuantState,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    pre_export,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.quantization.queries import without_integer_rules

LEVELS = [None, 0, 1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _strategy_off_afterwards():
    yield
    ConsistencyStrategy.disable()


class _Block(nn.Module):
    """Depthwise conv-bn-relu6, pointwise conv-bn, residual add."""

    def __init__(self, c: int):
        super().__init__()
        self.dw, self.bn1, self.act = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU6()
        self.pw, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.pw(self.act(self.bn1(self.dw(x)))))


class _MobileNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem, self.bn, self.act = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6()
        self.block = _Block(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.block(self.act(self.bn(self.stem(self.quant(x)))))
        return self.dequant(self.fc(self.pool(x).flatten(1)))


_STAGES: dict = {}


def _stages(level):
    """The net prepared at ``level``, calibrated, in VALIDATION; its pre_export model, qat IR, quantized IR and
    held-out inputs (built once per level; the profiler leaves the models as they were)."""
    if level not in _STAGES:
        _STAGES[level] = _build(level)
    return _STAGES[level]


def _build(level):
    torch.manual_seed(0)
    net = _MobileNetish()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2), m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.3, 0.3)
    net.eval()
    batches = [(torch.randn(4, 3, 16, 16),) for _ in range(5)]
    ConsistencyStrategy.set_consistency_level(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = calibrate(prepare(net, batches[0], default_calibration_qconfig_setter, check_result_dir=None),
                              batches[:3])
    finally:
        ConsistencyStrategy.disable()
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat_ir = export(model, batches[0])
    return model, pre_export(model, example_inputs=batches[0]), qat_ir, convert(qat_ir), batches[3:]


def _max_diff(a_fn, b_fn, batches) -> float:
    worst = 0.0
    for (x,) in batches:
        with torch.no_grad():
            worst = max(worst, float((a_fn(x) - b_fn(x)).abs().max()))
    return worst


@pytest.mark.parametrize("level", LEVELS, ids=lambda v: f"level{v}")
def test_each_stage_equals_the_model_it_is_meant_to_equal(level):
    model, _, qat_ir, qir, held_out = _stages(level)

    def traced(x):  # the forward export traces: float + fake quant, the level's integer rules off
        with without_integer_rules(model):
            return model(x)

    assert _max_diff(traced, qat_ir, held_out) == 0.0  # the qat IR at every level
    qat_vs_qat_ir = _max_diff(model, qat_ir, held_out)
    qat_vs_qir = _max_diff(model, qir, held_out)
    qat_ir_vs_qir = _max_diff(qat_ir, qir, held_out)
    if level is None or level == 0:  # no rule in the forward: the QAT model is what export traces
        assert qat_vs_qat_ir == 0.0
    else:  # the integer rules: the QAT model is the quantized IR, and the qat IR differs by just those rules
        assert qat_vs_qir == 0.0
        assert qat_vs_qat_ir == qat_ir_vs_qir


def _pair(baseline, analysis, kind, example, out_dir):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    qa.run()
    table = qa.compare_per_layer()
    return qa, table, qa.advise(table)


@pytest.mark.parametrize("level", [None, 1, 2, 4], ids=lambda v: f"level{v}")
def test_export_and_convert_pairs_report_no_fault_where_the_stage_is_what_the_level_defines(level, tmp_path):
    _, pe, qat_ir, qir, held_out = _stages(level)
    example = held_out[0]
    _, table, found = _pair(pe, qat_ir, "export", example, tmp_path / "export")
    assert all(r.lsb_verdict in ("", "bit-exact") and r.same_input_lsb_verdict in ("", "bit-exact") for r in table)
    assert not [f for f in found if f.rule == "export_path_differs"]

    qa, table, found = _pair(qat_ir, qir, "convert", example, tmp_path / "convert")
    advice = [f.advice for f in found if f.rule == "consistency_level"]
    if level is None:  # strategy off: the same kind of differences are what a level would remove
        assert any("set_consistency_level(" in a for a in advice)
    else:
        assert advice == []  # the qat IR lacks exactly the rules the level puts in the QAT model
        assert qa.consistency.baseline_rules == "none" and "not faults" in qa.consistency.line()
        _, table, found = _pair(pe, qir, "convert", example, tmp_path / "convert_pe")
        assert all(r.lsb_verdict in ("", "bit-exact") for r in table)  # the model it must equal: bit for bit
        assert not [f for f in found if f.rule == "consistency_level"]


# -- hand-computed: docs/march.md §10's add, q_a = 5 at 2^-4, q_b = 2 at 2^-5, output at 2^-3 ----------------------
class _Add(nn.Module):
    def __init__(self):
        super().__init__()
        self.qa, self.qb = QuantStub(scale=2**-4), QuantStub(scale=2**-5)
        self.dequant = DeQuantStub()

    def forward(self, a, b):
        return self.dequant(self.qa(a) + self.qb(b))


def test_level_1_add_by_stage_hand_computed(tmp_path):
    """The default qpp rounds each term to whole output steps: rhe(2.5) + rhe(0.5) = 2 + 0 = 2 steps; float + fake
    quant rounds the sum 0.375 once: 3 steps. At level 1 the QAT model and the quantized IR give 2 steps, the qat
    IR (and the model without the rules) 3; the export pair is bit-exact and the convert pair calls the one-step
    difference at the add the level's own rule."""
    a, b = torch.tensor([5 * 2**-4]), torch.tensor([2 * 2**-5])
    out = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=2**-3)))
    ConsistencyStrategy.set_consistency_level(1)
    model = prepare(_Add(), (a, b), (ModuleNameQconfigSetter({"add_0": out}), default_calibration_qconfig_setter),
                    check_result_dir=None)
    ConsistencyStrategy.disable()
    calibrate(model, [(a, b)])
    qat_ir = export(model, (a, b))
    qir = convert(qat_ir)
    with torch.no_grad():
        assert float(model(a, b)) == 2 * 2**-3
        with without_integer_rules(model):
            assert float(model(a, b)) == 3 * 2**-3
        assert float(model(a, b)) == 2 * 2**-3  # the block left the model as it was
    assert float(qat_ir(a, b)) == 3 * 2**-3
    assert float(qir(a, b)) == 2 * 2**-3

    _, table, found = _pair(pre_export(model), qat_ir, "export", (a, b), tmp_path / "export")
    assert table["add_0"].same_input_lsb_verdict == "bit-exact" and not found
    qa, table, found = _pair(qat_ir, qir, "convert", (a, b), tmp_path / "convert")
    assert table["add_0"].same_input_lsb_verdict == "within 1 LSB"
    assert not [f for f in found if f.rule == "consistency_level"]
    assert "not faults" in (tmp_path / "convert" / "abnormal_layer_advisor.txt").read_text()


def test_without_integer_rules_refuses_a_float_model():
    from quantlens.errors import QuantLensError

    with pytest.raises(QuantLensError, match="prepare"):
        with without_integer_rules(nn.Linear(2, 2)):
            pass
