"""Same-input outputs of op sites that run once per time step (a recurrent layer's steps share their op sites).

The last time step of ``c_t = f * c_{t-1} + i * g`` reads the previous step's ``c``: its same-input run must take
the baseline's value of that earlier occurrence of the site, not the analysis model's own (which carries the
error inherited over the steps before) and not the baseline's last occurrence.

* ``convert`` (qat IR -> quantized IR): the ground truth per site is the quantized IR's kernel run on the qat IR's
  own inputs of the node that computes the site's value (turned into codes) against the qat IR's fake-quant
  output codes. Measured on the models below: every row's same-input LSB equals it (before the fix ``mul_0``,
  ``linear_1`` and ``stack_0`` of the LSTM were off by up to 4 LSB where the truth is 0).
* torch pairs (``pre_export``): the ``k``-th run of a site takes the baseline's inputs of its ``k``-th run (before,
  every run took the inputs of the baseline's last run: the earlier runs' same-input outputs were off by up to 2.0).
"""

import re
import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.compiler.interpreter import dispatch_for
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.ir_access import IRModelAccess, SiteOverride
from quantlens.profiler.trace.reader import TraceReader
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

STEPS = 3
_STORAGE = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.q, self.rnn, self.dq = QuantStub(), cell(4, 8, 1, batch_first=True), DeQuantStub()

    def forward(self, x):
        y, _ = self.rnn(self.q(x))
        return self.dq(y[:, -1])


@pytest.fixture(scope="module", params=[nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def stages(request):
    torch.manual_seed(0)
    model = Recurrent(request.param).eval()
    example = (torch.randn(2, STEPS, 4),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None),
                          [example, (torch.randn(2, STEPS, 4),)])
        pe = pre_export(calib, example_inputs=example)
        qat_ir = export(pe, example)
    return calib, pe, qat_ir, convert(qat_ir), example


def _analyse(baseline, analysis, kind, example, out_dir):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    qa.run()
    return qa


def _true_steps(qat_ir, q_ir, example) -> dict[str, int]:
    """Per op site of the quantized IR: the most output steps its value's node is off when run on the qat IR's
    own inputs of that node (codes), against the qat IR's output codes."""
    values = {}
    qat_ir.run(qat_ir._feeds_from_call(example, {}), observer=lambda n, i, o: values.update(zip(n.outputs, o)))
    rounded = {n.inputs[0]: n.outputs[0] for n in reversed(qat_ir.graph.nodes) if n.op == "fake_quant"}

    def qat_value(name):  # the quantized IR's values are named <qat value>_q<k>
        base = re.sub(r"_q\d+$", "", name)
        return values[rounded.get(base, base)] if base in values else None

    consts, kernel, access = q_ir.graph.constants, dispatch_for(q_ir), IRModelAccess(q_ir, "analysis")
    truth = {}
    for site, i in access.last.items():
        node = access.nodes[i]
        info = q_ir.graph.values[node.outputs[0]]
        if not info.qdtype or node.op in ("quantize", "dequantize"):
            continue
        inputs = [consts[name] if name in consts else qat_value(name) if name else None for name in node.inputs]
        for k, name in enumerate(node.inputs):
            grid = q_ir.graph.values.get(name)
            if name not in consts and grid is not None and grid.qdtype:
                inputs[k] = torch.round(inputs[k] / consts[grid.scale]).to(_STORAGE[grid.qdtype])
        result = kernel(node, inputs)
        out = result[0] if isinstance(result, (list, tuple)) else result
        want = torch.round(qat_value(node.outputs[0]) / consts[info.scale])
        truth[site] = int((out.to(torch.int64) - want.to(torch.int64)).abs().max())
    return truth


def _worst(hist: str) -> int:
    """The largest bucket with elements in an LSB histogram ('0:52|1:12|2:0|...')."""
    worst = 0
    for bucket in hist.split("|"):
        label, count = bucket.split(":")
        if int(count):
            worst = 9 if label.startswith(">") else int(label.split("-")[-1])
    return worst


def test_convert_same_input_of_recurrent_sites_is_the_kernel_on_the_baselines_inputs(stages, tmp_path):
    _, _, qat_ir, q_ir, example = stages
    rows = _analyse(qat_ir, q_ir, "convert", example, tmp_path).compare_per_layer()
    truth = _true_steps(qat_ir, q_ir, example)
    checked = {r.op_name: (_worst(r.same_input_lsb_hist), truth[r.op_name]) for r in rows
               if r.op_name in truth and r.same_input_lsb_hist}
    assert len(checked) >= 8
    assert {site: got for site, got in checked.items() if got[0] != got[1]} == {}
    assert not [r.note for r in rows if "own" in r.note]
    # the model's own recurrent state differs from the baseline's here, so taking it would show
    assert any(r.lsb_verdict not in ("", "bit-exact") and truth.get(r.op_name) == 0 for r in rows)
    # the baseline trace holds the earlier occurrences the same-input runs read (the previous step's state)
    base = TraceReader(tmp_path / "baseline_model")
    assert max(base.occurrence_count(name) for name in base.by_name) >= 2
    assert base.occurrence(rows[0].op_name, -99) is None


def test_every_run_of_a_torch_site_takes_the_baselines_inputs_of_that_run(stages, tmp_path):
    calib, pe, _, _, example = stages
    _analyse(calib, pe, "pre_export", example, tmp_path)
    base, analy = TraceReader(tmp_path / "baseline_model"), TraceReader(tmp_path / "analysis_model")
    repeated = [name for name, runs in analy.occurrences.items() if len(runs) == STEPS]
    checked = 0
    for name in repeated:
        if analy.by_name[name].op_type not in ("mul", "add", "linear"):  # no table: the same op on both sides
            continue
        assert base.occurrence_count(name) == STEPS
        for k in range(STEPS):
            same, out = analy.tensors(name, k)["same0"], base.tensors(name, k)["out0"]
            assert torch.equal(same, out), (name, k)
            checked += 1
    assert checked >= 3 * STEPS


def test_a_site_that_runs_several_times_is_not_mixed(stages):
    """SiteOverride's program is a site's last occurrence: a reference's earlier call of the site keeps its value
    (before, every step of the input select took the last step's program value)."""
    _, _, _, q_ir, example = stages
    access = IRModelAccess(q_ir, "analysis")
    select = "rnn.l0.select_0"  # x[:, t], from the QuantStub's value at every step
    override = SiteOverride(access, {select})
    override.set_inputs(q_ir._feeds_from_call(example, {}))
    x = example[0]
    assert override.on_site_value("q", [x]) is None
    assert override.on_site_value(select, [x[:, 0]]) is None
