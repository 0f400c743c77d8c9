"""Every claim of ``docs/ops.md`` held on a model (issue #41 deliverable 9): each op type of the op set, called as a
user's model calls it, goes through every stage it is marked "yes" for, on the side it is marked to run on.

* ``NPU``: the op site is planned on the NPU at ``prepare`` (no host label), its nodes in the qat IR and in the
  quantized IR carry no host mark (convert gave it an integer rule), a table op has its table at ``pre_export``,
  and onnxruntime at its default options runs the file within a few output steps of the qat IR.
* ``host``: the op site is planned on the host and stays there at every stage, and the model still goes through.
* ``decomposed``: the composite op leaves no op site of its own; the ops it becomes go through every stage.

A new row in :data:`quantlens.march.opset.OPS` without an example here fails :func:`test_every_op_type_has_an_example`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.march.opset import OPS, Category
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, lut_sites, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def _seq(x):  # [2, 4, 6, 6] -> a [2, 5, 4] sequence
    return x.flatten(2).transpose(1, 2)[:, :5]


def _pos(x):
    return x.abs() + 0.5


#: op type -> how a model calls it on the quantized input x ([2, 4, 6, 6]); ``m`` holds the modules, ``ids`` is an
#: integer model input ([2, 5], values in [0, 10))
EXAMPLES = {
    "quant_stub": lambda m, x, ids: x,
    "dequant_stub": lambda m, x, ids: x,
    # composite: decomposed at prepare
    "baddbmm": lambda m, x, ids: torch.baddbmm(x.flatten(2)[:, :, :4], x.flatten(2), x.flatten(2).transpose(1, 2),
                                               beta=0.5, alpha=2.0),
    "glu": lambda m, x, ids: F.glu(x, dim=1),
    "group_norm": lambda m, x, ids: m.gn(x),
    "gru": lambda m, x, ids: m.gru(_seq(x))[0],
    "gru_cell": lambda m, x, ids: m.gru_cell(x[:, :, 0, 0]),
    "instance_norm": lambda m, x, ids: F.instance_norm(x),
    "lstm": lambda m, x, ids: m.lstm(_seq(x))[0],
    "lstm_cell": lambda m, x, ids: m.lstm_cell(x[:, :, 0, 0])[0],
    "multi_head_attention_forward": lambda m, x, ids: m.mha(_seq(x), _seq(x), _seq(x), need_weights=False)[0],
    "rnn_relu": lambda m, x, ids: m.rnn_relu(_seq(x))[0],
    "rnn_relu_cell": lambda m, x, ids: m.rnn_relu_cell(x[:, :, 0, 0]),
    "rnn_tanh": lambda m, x, ids: m.rnn_tanh(_seq(x))[0],
    "rnn_tanh_cell": lambda m, x, ids: m.rnn_tanh_cell(x[:, :, 0, 0]),
    # elementwise
    "abs": lambda m, x, ids: x.abs(),
    "add": lambda m, x, ids: x + x.transpose(2, 3),
    "batch_norm": lambda m, x, ids: m.bn(x),
    "cat": lambda m, x, ids: torch.cat([x, x.flip(1)], 1),
    "concat": lambda m, x, ids: torch.concat([x, x.flip(1)], 1),
    "clamp": lambda m, x, ids: x.clamp(-0.5, 0.7),
    "clip": lambda m, x, ids: x.clip(-0.5, 0.7),
    "hardtanh": lambda m, x, ids: F.hardtanh(x, -0.5, 0.7),
    "interpolate": lambda m, x, ids: F.interpolate(x, scale_factor=2),
    "leaky_relu": lambda m, x, ids: F.leaky_relu(x, 0.1),
    "masked_fill": lambda m, x, ids: x.masked_fill(x > 0.5, 0.0),
    "mul": lambda m, x, ids: x * x.transpose(2, 3),
    "neg": lambda m, x, ids: -x,
    "prelu": lambda m, x, ids: m.prelu(x),
    "relu6": lambda m, x, ids: F.relu6(x * 4),
    "rsub": lambda m, x, ids: torch.rsub(x, 1.0),
    "stack": lambda m, x, ids: torch.stack([x, x.flip(1)], 1),
    "sub": lambda m, x, ids: x - x.transpose(2, 3),
    "where": lambda m, x, ids: torch.where(x > 0, x, x.flip(1)),
    # gemm
    "addmm": lambda m, x, ids: torch.addmm(m.addmm_b, x.flatten(1), m.addmm_w),
    "bmm": lambda m, x, ids: torch.bmm(x.flatten(2), x.flatten(2).transpose(1, 2)),
    "conv1d": lambda m, x, ids: m.conv1d(x.flatten(2)),
    "conv2d": lambda m, x, ids: m.conv2d(x),
    "conv_transpose1d": lambda m, x, ids: m.convt1d(x.flatten(2)),
    "conv_transpose2d": lambda m, x, ids: m.convt2d(x),
    "linear": lambda m, x, ids: m.linear(x),
    "matmul": lambda m, x, ids: x @ x.transpose(2, 3),
    "mm": lambda m, x, ids: torch.mm(x[0, 0], x[0, 1]),
    "scaled_dot_product_attention": lambda m, x, ids: F.scaled_dot_product_attention(x, x, x),
    # index: the indices feed a gather (integers stay integers)
    "argmax": lambda m, x, ids: x.gather(1, x.argmax(1, keepdim=True)),
    "argmin": lambda m, x, ids: x.gather(1, x.argmin(1, keepdim=True)),
    "argsort": lambda m, x, ids: x.gather(-1, x.argsort(-1)),
    "float": lambda m, x, ids: x.float(),
    "to": lambda m, x, ids: x.to(torch.float32),
    "type": lambda m, x, ids: x.type(torch.float32),
    "embedding": lambda m, x, ids: m.emb(ids),
    # movement
    "adaptive_max_pool1d": lambda m, x, ids: F.adaptive_max_pool1d(x.flatten(2), 6),
    "adaptive_max_pool2d": lambda m, x, ids: F.adaptive_max_pool2d(x, 3),
    "amax": lambda m, x, ids: x.amax(-1),
    "amin": lambda m, x, ids: x.amin(-1),
    "chunk": lambda m, x, ids: x.chunk(2, 1)[1],
    "clone": lambda m, x, ids: x.clone(),
    "contiguous": lambda m, x, ids: x.transpose(2, 3).contiguous(),
    "detach": lambda m, x, ids: x.detach(),
    "dropout": lambda m, x, ids: m.drop(x),
    "expand": lambda m, x, ids: x[:, :1].expand(2, 4, 6, 6),
    "expand_as": lambda m, x, ids: x[:, :1].expand_as(x),
    "flatten": lambda m, x, ids: x.flatten(1),
    "flip": lambda m, x, ids: x.flip(-1),
    "gather": lambda m, x, ids: x.gather(-1, m.idx),
    "getitem": lambda m, x, ids: x[:, 1:3, ::2],
    "identity": lambda m, x, ids: m.ident(x),
    "index_select": lambda m, x, ids: x.index_select(1, m.sel),
    "max": lambda m, x, ids: x.max(-1).values,
    "max_pool1d": lambda m, x, ids: F.max_pool1d(x.flatten(2), 2),
    "max_pool1d_with_indices": lambda m, x, ids: F.max_pool1d(x.flatten(2), 2, return_indices=True)[0],
    "max_pool2d": lambda m, x, ids: F.max_pool2d(x, 2),
    "max_pool2d_with_indices": lambda m, x, ids: F.max_pool2d(x, 2, return_indices=True)[0],
    "min": lambda m, x, ids: x.min(-1).values,
    "movedim": lambda m, x, ids: x.movedim(1, -1),
    "narrow": lambda m, x, ids: x.narrow(2, 1, 3),
    "pad": lambda m, x, ids: F.pad(x, (1, 2), value=0.3),
    "permute": lambda m, x, ids: x.permute(0, 2, 3, 1),
    "pixel_shuffle": lambda m, x, ids: F.pixel_shuffle(x, 2),
    "pixel_unshuffle": lambda m, x, ids: F.pixel_unshuffle(x, 2),
    "relu": lambda m, x, ids: F.relu(x),
    "repeat": lambda m, x, ids: x.repeat(1, 2, 1, 1),
    "reshape": lambda m, x, ids: x.reshape(2, 4, 36),
    "reshape_as": lambda m, x, ids: x.reshape_as(m.shape_2x144),
    "roll": lambda m, x, ids: x.roll(1, -1),
    "select": lambda m, x, ids: x.select(1, 2),
    "sort": lambda m, x, ids: x.sort(-1).values,
    "split": lambda m, x, ids: x.split(3, 1)[1],
    "squeeze": lambda m, x, ids: x[:, :1].squeeze(1),
    "swapaxes": lambda m, x, ids: x.swapaxes(1, 3),
    "t": lambda m, x, ids: x[0, 0].t(),
    "tile": lambda m, x, ids: x.tile((1, 2, 1, 1)),
    "topk": lambda m, x, ids: x.topk(2, -1).values,
    "transpose": lambda m, x, ids: x.transpose(1, 2),
    "unbind": lambda m, x, ids: x.unbind(1)[2],
    "unflatten": lambda m, x, ids: x.flatten(2).unflatten(2, (3, 12)),
    "unsqueeze": lambda m, x, ids: x.unsqueeze(1),
    "view": lambda m, x, ids: x.view(2, 4, 36),
    "view_as": lambda m, x, ids: x.view_as(m.shape_2x144),
    # reduction
    "adaptive_avg_pool1d": lambda m, x, ids: F.adaptive_avg_pool1d(x.flatten(2), 6),
    "adaptive_avg_pool2d": lambda m, x, ids: F.adaptive_avg_pool2d(x, 2),
    "avg_pool1d": lambda m, x, ids: F.avg_pool1d(x.flatten(2), 2),
    "avg_pool2d": lambda m, x, ids: F.avg_pool2d(x, 2),
    "cumsum": lambda m, x, ids: x.cumsum(-1),
    "mean": lambda m, x, ids: x.mean(-1),
    "sum": lambda m, x, ids: x.sum(-1),
    # table
    "div": lambda m, x, ids: x / _pos(x),
    "elu": lambda m, x, ids: F.elu(x),
    "erf": lambda m, x, ids: torch.erf(x),
    "exp": lambda m, x, ids: x.exp(),
    "gelu": lambda m, x, ids: F.gelu(x),
    "hardsigmoid": lambda m, x, ids: F.hardsigmoid(x),
    "hardswish": lambda m, x, ids: F.hardswish(x),
    "layer_norm": lambda m, x, ids: m.ln(x),
    "linalg_vector_norm": lambda m, x, ids: torch.linalg.vector_norm(x, dim=-1),
    "log": lambda m, x, ids: _pos(x).log(),
    "log_softmax": lambda m, x, ids: F.log_softmax(x, -1),
    "norm": lambda m, x, ids: x.norm(dim=-1),
    "normalize": lambda m, x, ids: F.normalize(x, dim=1),
    "pow": lambda m, x, ids: x.pow(2),
    "reciprocal": lambda m, x, ids: _pos(x).reciprocal(),
    "rms_norm": lambda m, x, ids: F.rms_norm(x, (6,)),
    "rsqrt": lambda m, x, ids: _pos(x).rsqrt(),
    "sigmoid": lambda m, x, ids: x.sigmoid(),
    "silu": lambda m, x, ids: F.silu(x),
    "softmax": lambda m, x, ids: x.softmax(-1),
    "softplus": lambda m, x, ids: F.softplus(x),
    "sqrt": lambda m, x, ids: _pos(x).sqrt(),
    "square": lambda m, x, ids: x.square(),
    "tanh": lambda m, x, ids: x.tanh(),
}


class _OneOp(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.gn, self.bn, self.ln, self.prelu = nn.GroupNorm(2, 4), nn.BatchNorm2d(4), nn.LayerNorm(6), nn.PReLU(4)
        self.gru, self.gru_cell = nn.GRU(4, 4, batch_first=True), nn.GRUCell(4, 4)
        self.lstm, self.lstm_cell = nn.LSTM(4, 4, batch_first=True), nn.LSTMCell(4, 4)
        self.rnn_relu = nn.RNN(4, 4, nonlinearity="relu", batch_first=True)
        self.rnn_tanh = nn.RNN(4, 4, batch_first=True)
        self.rnn_relu_cell, self.rnn_tanh_cell = nn.RNNCell(4, 4, nonlinearity="relu"), nn.RNNCell(4, 4)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True)
        self.conv1d, self.conv2d = nn.Conv1d(4, 4, 3), nn.Conv2d(4, 4, 3)
        self.convt1d, self.convt2d = nn.ConvTranspose1d(4, 4, 2), nn.ConvTranspose2d(4, 4, 2)
        self.linear, self.emb = nn.Linear(6, 3), nn.Embedding(10, 6)
        self.drop, self.ident = nn.Dropout(0.1), nn.Identity()
        self.addmm_w, self.addmm_b = nn.Parameter(torch.randn(144, 3) * 0.1), nn.Parameter(torch.randn(3))
        self.register_buffer("idx", torch.randint(0, 6, (2, 4, 6, 3)))
        self.register_buffer("sel", torch.tensor([3, 0]))
        self.register_buffer("shape_2x144", torch.zeros(2, 144))

    def forward(self, x, ids):
        return self.dequant(EXAMPLES[self.op](self, self.quant(x), ids))


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 6, 6, generator=g), torch.randint(0, 10, (2, 5), generator=g)


def _runs_on(op: str) -> str:
    d = OPS[op]
    return "decomposed" if d.category is Category.COMPOSITE else "NPU" if d.on_npu else "host"


_TYPES = sorted(n for n, d in OPS.items() if d.category is not Category.METADATA)


def test_every_op_type_has_an_example():
    assert sorted(EXAMPLES) == _TYPES, "give each op type of quantlens.march.opset.OPS an example call here"


def _marked_host(node) -> bool:
    return bool(node.attrs.get("host")) or node.op == "host_aten"


@pytest.mark.parametrize("op", _TYPES)
def test_each_op_runs_where_docs_ops_md_says_through_every_stage(op, tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    model = _OneOp(op).eval()
    example = _inputs(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, [_inputs(s) for s in (1, 2)])
    plans = prepared._quantlens_state.plans
    where = _runs_on(op)
    sites = [s for s, p in plans.items() if p.op_type == op]
    if where == "decomposed":
        assert not sites, f"{op} is decomposed at prepare, yet op sites {sites} keep its name"
    else:  # an op making only indices may have no op site (integers stay integers): its IR nodes are checked below
        assert sites or OPS[op].index_producing, f"no op site of type {op!r} in {sorted(plans)}"
        assert all(plans[s].host is (where == "host") for s in sites), (op, where, {s: plans[s].host for s in sites})
    table_model = pre_export(prepared, example_inputs=example)
    if where == "NPU" and OPS[op].table:
        assert set(sites) <= set(lut_sites(table_model)), (op, sites, lut_sites(table_model))
    qat_ir = export(table_model, example, dynamic_batch=False)
    quantized = convert(qat_ir)
    for module in (qat_ir, quantized):
        marks = {n.op: _marked_host(n) for n in module.graph.nodes if n.site in sites}
        if not sites:  # an index op: its IR ops (NPU), or the host op that calls it
            marks = {n.op: _marked_host(n) for n in module.graph.nodes if n.op in OPS[op].ir
                     or n.attrs.get("target", "").startswith(f"aten::{op}.")}
            assert marks or where == "decomposed", (op, module.kind, [n.op for n in module.graph.nodes])
        assert all(m is (where == "host") for m in marks.values()), (op, module.kind, marks)
    if where == "decomposed":  # the ops it became: on the NPU
        assert not [n.op for n in quantized.graph.nodes if _marked_host(n) and n.site], op
    held_out = _inputs(3)
    with torch.no_grad():
        expected = qat_ir(*held_out)
        got_int = quantized(*held_out)
    assert got_int.shape == expected.shape and torch.isfinite(got_int).all()
    path = to_onnx(qat_ir, tmp_path / f"{op}.onnx")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])  # default level
    feed = {i.name: v.numpy() for i, v in zip(session.get_inputs(), held_out)}
    got = session.run(None, feed)[0]
    state = prepared._quantlens_state  # the output's grid: the last output fake quant before the DeQuantStub
    step = float(state.fq[[p.output_fq for s, p in plans.items() if p.output_fq and s != "dequant"][-1]].scale.max())
    assert np.abs(got - expected.numpy()).max() <= 2 * step + 1e-5 * float(expected.abs().max()), op
