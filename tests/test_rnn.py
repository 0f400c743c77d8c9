"""LSTM / LSTMCell / GRU / GRUCell: decomposed at prepare into gate op sites, one set of quantizers for all steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export
from quantlens.compiler.ir import Module
from quantlens.errors import QuantLensError
from quantlens.march.opset import OPS, Category
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    calibrate,
    get_op_sites,
    pre_export,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.plan import OutputMode
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter, default_qat_qconfig_setter
from quantlens.sites.op_rules import OpKind, function_rule

CALIB = default_calibration_qconfig_setter
LSTM_CELL_SITES = [
    "linear_0", "linear_1", "add_0", "chunk_0", "sigmoid_0", "sigmoid_1", "tanh_0", "sigmoid_2",
    "mul_0", "mul_1", "add_1", "tanh_1", "mul_2",
]
GRU_CELL_SITES = [
    "linear_0", "chunk_0", "linear_1", "chunk_1", "add_0", "sigmoid_0", "add_1", "sigmoid_1", "mul_0", "add_2",
    "tanh_0", "sub_0", "mul_1", "add_3",
]


def _leaves(out):
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _max_diff(a, b) -> float:
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb) and la
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def _prep(model, example, setter=CALIB, **kw):
    return prepare(model, example, setter, check_result_dir=None, **kw, allow_no_stubs=True)


class CellLoop(nn.Module):
    """A cell called step by step in the user's loop; the state is optional and passed across calls."""

    def __init__(self, cell=nn.LSTMCell, hidden=8):
        super().__init__()
        self.cell = cell(3, hidden)

    def forward(self, x, state=None):
        outs = []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1), state


class Seq(nn.Module):
    def __init__(self, cls=nn.LSTM, **kw):
        super().__init__()
        self.rnn = cls(3, 8, **kw)

    def forward(self, x, hx=None):
        return self.rnn(x, hx)


class Deployed(nn.Module):
    """Stubs around a recurrent core, outputs dequantized (for export / convert)."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.q = QuantStub()
        self.core = core
        self.dq_out = DeQuantStub()
        self.dq_h = DeQuantStub()

    def forward(self, x):
        out, state = self.core(self.q(x))
        h = state[0] if isinstance(state, tuple) else state
        return self.dq_out(out), self.dq_h(h)


def _batches(n, length, seed=1, batch=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, 3, generator=gen) for _ in range(n)]


# -- float equivalence -------------------------------------------------------------------------------------------
SEQ_CASES = [
    (nn.LSTM, dict(batch_first=True), False),
    (nn.LSTM, dict(batch_first=False), True),
    (nn.LSTM, dict(batch_first=True, num_layers=2), True),
    (nn.LSTM, dict(batch_first=True, num_layers=2, bidirectional=True), False),
    (nn.LSTM, dict(batch_first=False, bidirectional=True), True),
    (nn.LSTM, dict(batch_first=True, proj_size=4, bias=False), False),
    (nn.GRU, dict(batch_first=True), False),
    (nn.GRU, dict(batch_first=False, num_layers=2), True),
    (nn.GRU, dict(batch_first=True, num_layers=2, bidirectional=True), True),
    (nn.RNN, dict(batch_first=True), False),
    (nn.RNN, dict(batch_first=False, num_layers=2, nonlinearity="relu"), True),
    (nn.RNN, dict(batch_first=True, bidirectional=True, bias=False), True),
]


def _initial_state(cls, kw, batch):
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    h = torch.randn(layers, batch, kw.get("proj_size") or 8)
    return (h, torch.randn(layers, batch, 8)) if cls is nn.LSTM else h


@pytest.mark.parametrize("cls,kw,with_state", SEQ_CASES)
def test_sequence_float_state_equals_torch(cls, kw, with_state):
    torch.manual_seed(0)
    model = Seq(cls, **kw).eval()
    x = torch.randn(2, 5, 3) if kw.get("batch_first") else torch.randn(5, 2, 3)
    example = (x, _initial_state(cls, kw, 2)) if with_state else (x,)
    prepared = _prep(model, example)
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        ref, got = model(*example), prepared(*example)
    assert _max_diff(ref, got) <= 1e-6
    # the fake quants are really on the gate ops: VALIDATION differs from float, but only by quantization
    calibrate(prepared, [example])
    with torch.no_grad():
        quantized = prepared(*example)
    assert 1e-4 < _max_diff(ref, quantized) < 0.1


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.RNNCell,
                                  lambda i, h: nn.RNNCell(i, h, nonlinearity="relu")],
                         ids=["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_cell_loop_float_state_equals_torch_and_unbatched_input(cell):
    torch.manual_seed(0)
    model = CellLoop(cell).eval()
    x = torch.randn(2, 6, 3)
    prepared = _prep(model, (x,))
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        assert _max_diff(model(x), prepared(x)) <= 1e-6
    # unbatched input (the cell unsqueezes inside its forward)
    unbatched = nn.Sequential(cell(3, 4)).eval()
    v = torch.randn(3)
    p = _prep(unbatched, (v,))
    set_fake_quantize(p, FakeQuantState.FLOAT)
    with torch.no_grad():
        assert _max_diff(unbatched(v), p(v)) <= 1e-6


# -- op sites ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cell,gates", [(nn.LSTMCell, LSTM_CELL_SITES), (nn.GRUCell, GRU_CELL_SITES)])
def test_cell_gate_op_sites_are_listed_in_the_record(cell, gates):
    model = CellLoop(cell).eval()
    x = torch.randn(2, 4, 3)
    sites = get_op_sites(model, (x,))
    assert [s for s in sites if s.startswith("cell.")] == [f"cell.{g}" for g in gates]
    assert not any(s.split(".")[-1].startswith(("lstm", "gru")) for s in sites)  # the fused op has no site
    prepared = _prep(model, (x,))
    # prepared model: the same names, visited once per step
    visited = get_op_sites(prepared, (x,))
    assert list(dict.fromkeys(visited)) == sites
    assert visited.count("cell.linear_0") == 4
    state = prepared._quantlens_state
    for g in gates:
        plan = state.plans[f"cell.{g}"]
        if g.startswith("chunk"):
            assert plan.output is OutputMode.INHERIT
        else:
            assert plan.output is OutputMode.QUANTIZED and plan.output_fq in state.fq, g
    for g in ("linear_0", "linear_1"):  # functional linear on the cell's Parameters: int8 weight, int32 bias
        plan = state.plans[f"cell.{g}"]
        assert 1 in plan.weight_fq and plan.bias_position == 2
        assert state.fq[plan.weight_fq[1]].is_weight


def test_lstm_sites_per_layer_and_direction():
    model = Seq(nn.LSTM, batch_first=True, num_layers=2, bidirectional=True).eval()
    sites = get_op_sites(model, (torch.randn(2, 4, 3),))
    for scope in ("rnn.l0", "rnn.l0_reverse", "rnn.l1", "rnn.l1_reverse"):
        assert [s for s in sites if s.startswith(scope + ".")] == [f"{scope}.select_0"] + [
            f"{scope}.{g}" for g in LSTM_CELL_SITES]
    assert {"rnn.stack_0", "rnn.stack_1", "rnn.cat_0"} <= set(sites)
    assert function_rule("lstm").kind is OpKind.COMPOSITE
    for name in ("lstm", "lstm_cell", "gru", "gru_cell"):
        assert OPS[name].category is Category.COMPOSITE and OPS[name].refused_by() == []


# -- shared quantizers -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("core", [lambda: CellLoop(nn.LSTMCell), lambda: Seq(nn.GRU, batch_first=True)])
def test_one_set_of_quantizers_for_all_time_steps(core):
    torch.manual_seed(0)
    model = core().eval()
    short = _prep(model, (torch.randn(2, 3, 3),))
    long = _prep(model, (torch.randn(2, 7, 3),))
    assert set(short._quantlens_state.fq) == set(long._quantlens_state.fq)  # independent of the length
    rec = long._quantlens_state.record.sites
    first = next(n for n in rec if n.endswith("linear_0"))
    assert rec[first].calls == 7
    # every step is observed by the same quantizer: a large input at the last step only moves its scale
    small = [torch.randn(2, 5, 3) * 0.1 for _ in range(3)]
    spiky = [b.clone() for b in small]
    spiky[1][:, -1] = 20.0
    key = long._quantlens_state.plans[first].output_fq
    scales = []
    for data in (small, spiky):
        p = _prep(model, (torch.randn(2, 3, 3),))
        calibrate(p, data)
        scales.append(p._quantlens_state.fq[key].scale.item())
        with torch.no_grad():
            p(torch.randn(2, 11, 3))  # a sequence longer than any seen at prepare runs (no unseen op site)
    assert scales[1] > 10 * scales[0]


# -- state across calls ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("core,exact", [(lambda: CellLoop(nn.LSTMCell), True), (lambda: CellLoop(nn.GRUCell), True),
                                        (lambda: Seq(nn.LSTM, batch_first=True), True),
                                        (lambda: Seq(nn.GRU, batch_first=True), True),
                                        (lambda: Seq(nn.LSTM, batch_first=True, num_layers=2), False)],
                         ids=["lstm_cell", "gru_cell", "lstm", "gru", "lstm_2layer"])
def test_state_passed_across_calls(core, exact):
    torch.manual_seed(0)
    model = core().eval()
    x = torch.randn(2, 8, 3)
    x1, x2 = x[:, :3], x[:, 3:]
    prepared = _prep(model, (x1,), extra_example_inputs=[(x2, model(x1)[1])])
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        ref_out, ref_state = model(x)
        out1, state = prepared(x1)
        out2, state = prepared(x2, state)
    assert _max_diff((ref_out, ref_state), (torch.cat([out1, out2], 1), state)) <= 1e-6
    # with fake quants on, splitting the sequence across calls computes exactly what one call computes: the
    # state enters the next call through the same quantizers as between two steps of one call. With several
    # layers, h_n / c_n stack the layers' states into one tensor (one scale), which requantizes them.
    calibrate(prepared, _batches(3, 8))
    with torch.no_grad():
        whole_out, whole_state = prepared(x)
        out1, state = prepared(x1)
        out2, state = prepared(x2, state)
    split = torch.cat([out1, out2], 1)
    if exact:
        torch.testing.assert_close(split, whole_out, rtol=0, atol=0)
        torch.testing.assert_close(_leaves(state), _leaves(whole_state), rtol=0, atol=0)
    else:
        assert 0 < (split - whole_out).abs().max() < 0.05 * whole_out.abs().max()
    assert _max_diff(whole_out, ref_out) > 1e-4  # quantized


# -- QAT ---------------------------------------------------------------------------------------------------------
def test_qat_gradients_reach_every_gate_weight():
    torch.manual_seed(0)
    model = Seq(nn.LSTM, batch_first=True, num_layers=2)
    x = torch.randn(2, 4, 3)
    prepared = prepare(model, (x,), default_qat_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    prepared.train()
    set_fake_quantize(prepared, FakeQuantState.QAT)
    out, (h, c) = prepared(x)
    (out.square().mean() + c.square().mean()).backward()
    for name, p in prepared.rnn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_packed_sequence_is_refused():
    model = Seq(nn.LSTM, batch_first=True).eval()
    x = torch.randn(2, 4, 3)
    packed = pack_padded_sequence(x, torch.tensor([4, 2]), batch_first=True)
    with pytest.raises(QuantLensError, match="PackedSequence"):
        _prep(model, (packed,))


# -- export / convert --------------------------------------------------------------------------------------------
def _output_step(qat_ir, name: str) -> float:
    """The quantization step of a model output: the scale of the fake quant it comes from (through movement)."""
    producers = qat_ir.graph.producers()
    node = producers[name]
    while node.op != "fake_quant":
        assert node.op in ("reshape", "select", "slice", "split"), node
        node = producers[node.inputs[0]]
    return float(qat_ir.graph.constants[node.inputs[1]].max())


_ALLOWED_IR = {"fake_quant", "linear", "add", "sub", "mul", "lut", "segment_lut", "split", "select", "slice", "cat",
               "reshape", "relu"}  # (relu: nn.RNN with nonlinearity="relu")


@pytest.mark.parametrize("core", [lambda: CellLoop(nn.LSTMCell), lambda: Seq(nn.LSTM, batch_first=True),
                                  lambda: Seq(nn.LSTM, num_layers=2, bidirectional=True),
                                  lambda: Seq(nn.GRU, batch_first=True, num_layers=2),
                                  lambda: Seq(nn.RNN, batch_first=True, num_layers=2, bidirectional=True),
                                  lambda: CellLoop(lambda i, h: nn.RNNCell(i, h, nonlinearity="relu"))],
                         ids=["lstm_cell", "lstm", "lstm_2layer_bidir", "gru_2layer", "rnn_2layer_bidir",
                              "rnn_relu_cell"])
def test_export_and_convert_within_two_output_steps(core):
    torch.manual_seed(0)
    model = Deployed(core()).eval()
    x = torch.randn(2, 5, 3)
    prepared = _prep(model, (x,))
    calibrate(prepared, _batches(4, 5))
    tables = pre_export(prepared)
    qat_ir = export(prepared, (x,))
    assert set(qat_ir.statistics()) <= _ALLOWED_IR, qat_ir.statistics()
    assert {n.site for n in qat_ir.graph.nodes if n.op == "lut"} >= {
        s for s in prepared._quantlens_state.plans if s.rsplit(".", 1)[-1].startswith(("sigmoid", "tanh"))}
    q_ir = convert(qat_ir)
    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    steps = [_output_step(qat_ir, name) for name in qat_ir.graph.outputs]
    for batch in _batches(3, 5, seed=7):
        with torch.no_grad():
            ref = _leaves(tables(batch))
        torch.testing.assert_close(_leaves(qat_ir(batch)), ref, rtol=1e-6, atol=1e-6)
        for r, g, step in zip(ref, _leaves(q_ir(batch)), steps):
            # default qpp: F = 0 adds round each term, so the recurrent state gains up to a step per time step
            # (5 here) on top of the high-precision model's 2 (measured 4)
            assert (r - g).abs().max().item() <= 6 * step + 1e-7
        for r, g, step in zip(ref, _leaves(high(batch)), steps):
            assert (r - g).abs().max().item() <= 2 * step + 1e-7


def test_a_cell_called_from_two_source_lines_prepares_and_shares_its_sites():
    class TwoLines(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.cell = nn.LSTMCell(4, 8)

        def forward(self, x):
            x = self.quant(x)
            h, c = self.cell(x[:, 0])  # the first step on its own line, the rest in a loop
            for t in range(1, x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return self.dequant(h)

    torch.manual_seed(0)
    model = TwoLines()
    x = torch.randn(2, 3, 4)
    prepared = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    sites = [n for n in prepared._quantlens_state.plans if n.startswith("cell.")]
    assert "cell.sigmoid_0" in sites and not any("@" in n for n in sites)  # one set of sites for every step
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        assert torch.allclose(prepared(x), model(x), atol=1e-6)
