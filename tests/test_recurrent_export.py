"""Export of nn.LSTM / nn.GRU folds the time steps: torch.export traces three steps per layer, the IR repeats them.

The IR stays the one a full trace gives (one node per gate op and time step, each with its step's op site); only
the cost of torch.export no longer grows with the sequence length (``sites/rnn_fold.py``,
``compiler/lowering/recurrence.py``). Timings are in ``benchmarks/bench_recurrent_export.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import quantlens.sites.rnn as rnn
from quantlens.compiler import convert, export
from quantlens.compiler.ir import Graph, Node, ValueInfo
from quantlens.compiler.lowering.recurrence import _repeat, _template
from quantlens.compiler.lowering.rules import LoweringContext as _Ctx
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.sites.rnn_fold import TRACED_STEPS, unrolled_export


class Deployed(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = QuantStub()
        self.rnn = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.dq_out, self.dq_h = DeQuantStub(), DeQuantStub()

    def forward(self, x):
        out, (h, _) = self.rnn(self.q(x))
        return self.dq_out(out), self.dq_h(h)


def _prepared(length: int):
    torch.manual_seed(0)
    model = Deployed().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, length, 3, generator=gen)
    prepared = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, [torch.randn(2, length, 3, generator=gen) for _ in range(2)])
    return prepared, x


def _canonical(ir):
    """The IR up to value names: ops, op sites, attributes, output types, inputs by producer (constants by value)."""
    g = ir.graph
    names = {n: f"input{i}" for i, n in enumerate(g.inputs)}
    constants: dict = {}

    def ref(name):
        if not name or name in names:
            return names.get(name, "")
        c = g.constants[name]
        return constants.setdefault((str(c.dtype), tuple(c.shape), c.numpy().tobytes()), f"const{len(constants)}")

    nodes = []
    for i, node in enumerate(g.nodes):
        inputs = tuple(ref(x) for x in node.inputs)
        names.update({o: f"v{i}.{j}" for j, o in enumerate(node.outputs)})
        nodes.append((node.op, node.site, inputs, repr(sorted(node.attrs.items())),
                      tuple((g.values[o].shape, g.values[o].dtype) for o in node.outputs)))
    return nodes, [ref(o) for o in g.outputs]


@pytest.fixture(scope="module")
def exports():
    """Folded exports at 5 and 8 steps, the unrolled (every step traced) export at 5, and the steps traced."""
    traced = Counter()
    step = rnn._lstm_step

    def counting(*args, **kwargs):
        traced[is_fake(args[0])] += 1  # torch.export traces on fake tensors
        return step(*args, **kwargs)

    result = {}
    rnn._lstm_step = counting
    try:
        for length in (5, 8):
            prepared, x = _prepared(length)
            traced.clear()
            result[length] = (prepared, x, export(prepared, (x,)), traced[True])
        with unrolled_export():
            prepared, x, _, _ = result[5]
            result["unrolled"] = export(prepared, (x,))
    finally:
        rnn._lstm_step = step
    return result


def test_folded_ir_equals_the_unrolled_ir(exports):
    prepared, x, folded, _ = exports[5]
    unrolled = exports["unrolled"]
    assert _canonical(folded) == _canonical(unrolled)
    for a, b in zip(folded(x), unrolled(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_export_traces_three_steps_per_layer_whatever_the_length(exports):
    assert exports[5][3] == exports[8][3] == 2 * TRACED_STEPS  # 2 layers


def test_each_step_has_its_nodes_at_each_op_site_and_the_ir_grows_linearly(exports):
    counts = {length: Counter(n.site for n in exports[length][2].graph.nodes if n.site.startswith("rnn.l"))
              for length in (5, 8)}
    assert set(counts[5]) == set(counts[8])  # the same op sites, whatever the length
    assert "rnn.l0.select_0" in counts[5] and "rnn.l1.select_0" not in counts[5]  # layer 1 reads a list of steps
    grown = {site: counts[8][site] - counts[5][site] for site in counts[5]}
    assert all(g > 0 and g % 3 == 0 for g in grown.values()), grown  # k nodes per site in each of 3 more steps
    assert grown["rnn.l0.sigmoid_1"] == grown["rnn.l1.mul_2"] == 3 * 2  # the table op and its output fake quant
    # outside the steps, only the output stack grows: one reshape per step before its cat (as in a full trace)
    outside = {length: Counter((n.site, n.op) for n in exports[length][2].graph.nodes
                               if not n.site.startswith("rnn.l")) for length in (5, 8)}
    assert outside[8] - outside[5] == Counter({("rnn.stack_0", "reshape"): 3}) and not outside[5] - outside[8]


def test_quantized_ir_agrees_with_the_qat_ir(exports):
    prepared, x, folded, _ = exports[8]
    quantized = convert(folded)
    batch = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(5))
    for a, b in zip(folded(batch), quantized(batch)):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.998


# -- the template and its repetition, on a hand-made IR ------------------------------------------------------------
def _ctx() -> _Ctx:
    values = {name: ValueInfo((2, 4), "float32") for name in ("seq", "h0", "w", "s1", "a", "s2", "b")}
    graph = Graph(nodes=[], inputs=["seq", "h0"], outputs=[], constants={"w": torch.ones(2, 4)}, values=values)
    return _Ctx(graph)


def _iteration(index: int, state: str, select: str, out: str, site: str = "rnn.l0.mul_0") -> list[Node]:
    return [Node("select", ["seq"], [select], {"dim": 1, "index": index}, "rnn.l0.select_0"),
            Node("mul", [select, state, "w"], [out], {}, site)]


def test_repeat_wires_the_state_and_moves_integer_attributes_on():
    ctx = _ctx()
    first = _iteration(6, "h0", "s1", "a")  # the reverse direction: 6, 5, then 4, 3
    second = _iteration(5, "a", "s2", "b")
    template = _template(ctx, first, second, (["h0"], ["a"], ["b"]), [])
    outs = _repeat(ctx, template, ["b"], [], 2)
    made = ctx.graph.nodes
    assert [(n.op, n.attrs.get("index"), n.site) for n in made] == [
        ("select", 4, "rnn.l0.select_0"), ("mul", None, "rnn.l0.mul_0"),
        ("select", 3, "rnn.l0.select_0"), ("mul", None, "rnn.l0.mul_0")]
    assert made[1].inputs == [made[0].outputs[0], "b", "w"]
    assert made[3].inputs == [made[2].outputs[0], made[1].outputs[0], "w"]
    assert outs == [made[1].outputs[0], made[3].outputs[0]]
    assert all(ctx.graph.values[o].shape == (2, 4) for n in made for o in n.outputs)


def test_two_steps_that_differ_are_refused_naming_the_op_site():
    ctx = _ctx()
    first = _iteration(1, "h0", "s1", "a")
    second = _iteration(2, "a", "s2", "b", site="rnn.l0.mul_1")
    with pytest.raises(QuantLensError, match=r"rnn\.l0\.mul_0.*unrolled_export"):
        _template(ctx, first, second, (["h0"], ["a"], ["b"]), [])
    second = _iteration(2, "h0", "s2", "b")  # reads the initial state, not the state after iteration 1
    with pytest.raises(QuantLensError, match="input 1"):
        _template(ctx, first, second, (["h0"], ["a"], ["b"]), [])


def test_the_placeholder_has_no_eager_computation():
    h = torch.zeros(1, 2)
    with pytest.raises(QuantLensError, match="placeholder"):
        torch.ops.quantlens.recurrent_steps([h], [h], [h], [], 0, 1)
