"""LSTM, GRU and the plain (tanh / ReLU) RNN as the NPU computes them: one op site per gate op, one set of op sites shared by all time steps.

torch runs ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.LSTM`` / ``nn.GRU`` as one fused op each (``torch._VF.lstm_cell``,
``_VF.gru_cell``, ``_VF.lstm``, ``_VF.gru``), which the march cannot run. The op set declares those four as
``COMPOSITE`` (no op site of their own); when the tracer meets one it calls the Python decomposition below with
the tracer active, so every gate op (``linear`` with int8 weights and an int32 bias, ``add``, ``chunk``,
``sigmoid`` / ``tanh``, ``mul``, ``sub``) is an ordinary op site: prepared, observed, fake-quantized, turned into
tables by ``pre_export`` and captured by ``torch.export``. The float computation is torch's own, op for op
(``aten/src/ATen/native/RNN.cpp``).

Op site names (``docs/quantization.md``, "Recurrent layers"):

* a cell ``nn.LSTMCell`` at ``cell``: ``cell.linear_0`` (input projection, ``W_ih x + b_ih``), ``cell.linear_1``
  (hidden projection), ``cell.add_0`` (gates), ``cell.chunk_0``, ``cell.sigmoid_0`` / ``sigmoid_1`` / ``tanh_0`` /
  ``sigmoid_2`` (input, forget, cell, output gate), ``cell.mul_0`` (f·c), ``cell.mul_1`` (i·g), ``cell.add_1``
  (new c), ``cell.tanh_1``, ``cell.mul_2`` (new h), and ``cell.linear_2`` for ``proj_size``;
* ``nn.GRUCell`` at ``cell``: ``cell.linear_0`` / ``linear_1``, ``cell.chunk_0`` / ``chunk_1``, ``cell.add_0`` +
  ``cell.sigmoid_0`` (reset gate r), ``cell.add_1`` + ``cell.sigmoid_1`` (update gate z), ``cell.mul_0`` (r·hn),
  ``cell.add_2`` + ``cell.tanh_0`` (new gate n), ``cell.sub_0``, ``cell.mul_1``, ``cell.add_3``
  (new h = (h - n)·z + n);
* ``nn.LSTM`` / ``nn.GRU`` at ``rnn``: the same gate sites per layer and direction under ``rnn.l<k>`` and
  ``rnn.l<k>_reverse`` (torch's parameter suffixes: ``weight_ih_l0_reverse``), e.g. ``rnn.l0.sigmoid_1``; the
  sequence ops around them (``rnn.getitem_0`` for the initial state, ``rnn.stack_0``, ``rnn.cat_0`` ...) are in
  ``rnn``'s own scope; a layer selects its time step inside the step scope (``rnn.l0.select_0``).

Every call of a cell, and every time step of a layer, reuses the same op site names (the tracer restarts the op
counters of a recurrent module at each call, and of a layer scope at each step), so one set of quantizers is
shared by all time steps, whatever the sequence length.

At export, ``torch.export`` traces three time steps of each layer and direction; the IR repeats them for the rest
(``rnn_fold.py``), so export time no longer grows with the traced length while the IR keeps one node per gate op
and time step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.sites.gemm_decompositions import GEMM_DECOMPOSED_FUNCTIONS
from quantlens.sites.norm_decompositions import NORM_DECOMPOSED_FUNCTIONS
from quantlens.sites.rnn_fold import folds, run_folded
from quantlens.sites.source_location import ForwardTracer

__all__ = ["DECOMPOSED_FUNCTIONS", "lstm_cell", "gru_cell", "lstm", "gru"]


# -- one time step (the op order is torch's, so FLOAT results match it) -------------------------------------------
def _lstm_step(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None, w_hr=None):
    gates = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, 1)
    i = torch.sigmoid(i)
    f = torch.sigmoid(f)
    g = torch.tanh(g)
    o = torch.sigmoid(o)
    c = f * c + i * g
    h = o * torch.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _gru_step(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    i_r, i_z, i_n = F.linear(x, w_ih, b_ih).chunk(3, 1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, 1)
    r = torch.sigmoid(h_r + i_r)
    z = torch.sigmoid(h_z + i_z)
    n = torch.tanh(i_n + h_n * r)
    return (h - n) * z + n


def _rnn_step(x, h, w_ih, w_hh, b_ih=None, b_hh=None, relu=False):
    pre = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    return torch.relu(pre) if relu else torch.tanh(pre)


# -- the _VF functions ----------------------------------------------------------------------------------------------
def lstm_cell(tracer: ForwardTracer, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``_VF.lstm_cell(input, (h, c), w_ih, w_hh, b_ih, b_hh) -> (h, c)``."""
    h, c = hx
    return _lstm_step(input, h, c, w_ih, w_hh, b_ih, b_hh)


def gru_cell(tracer: ForwardTracer, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    """``_VF.gru_cell(input, h, w_ih, w_hh, b_ih, b_hh) -> h``."""
    return _gru_step(input, hx, w_ih, w_hh, b_ih, b_hh)


def lstm(tracer: ForwardTracer, *args):
    """``_VF.lstm(input, (h0, c0), params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``
    ``-> (output, h_n, c_n)``."""
    if len(args) < 9 or isinstance(args[1], torch.Tensor):
        raise QuantLensError(_PACKED.format(kind="LSTM", module=_scope(tracer, "") or "<root>"))
    input, (h0, c0), params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args[:9]
    output, h_n, c_n = _sequence(tracer, "lstm", input, [h0, c0], params, has_biases, num_layers, dropout, train,
                                 bidirectional, batch_first)
    return output, h_n, c_n


def gru(tracer: ForwardTracer, *args):
    """``_VF.gru(input, h0, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``
    ``-> (output, h_n)``."""
    if len(args) < 9 or not isinstance(args[2], (list, tuple)):
        raise QuantLensError(_PACKED.format(kind="GRU", module=_scope(tracer, "") or "<root>"))
    input, h0, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args[:9]
    output, h_n = _sequence(tracer, "gru", input, [h0], params, has_biases, num_layers, dropout, train,
                            bidirectional, batch_first)
    return output, h_n


def _rnn_cell(relu: bool) -> Callable[..., Any]:
    def cell(tracer: ForwardTracer, input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
        return _rnn_step(input, hx, w_ih, w_hh, b_ih, b_hh, relu)

    cell.__doc__ = f"``_VF.rnn_{'relu' if relu else 'tanh'}_cell(input, h, w_ih, w_hh, b_ih, b_hh) -> h``."
    return cell


def _rnn(relu: bool) -> Callable[..., Any]:
    kind = "rnn_relu" if relu else "rnn_tanh"

    def rnn(tracer: ForwardTracer, *args):
        if len(args) < 9 or not isinstance(args[2], (list, tuple)):
            raise QuantLensError(_PACKED.format(kind="RNN", module=_scope(tracer, "") or "<root>"))
        input, h0, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args[:9]
        return _sequence(tracer, kind, input, [h0], params, has_biases, num_layers, dropout, train, bidirectional,
                         batch_first)

    rnn.__doc__ = (f"``_VF.{kind}(input, h0, params, has_biases, num_layers, dropout, train, bidirectional, "
                   "batch_first) -> (output, h_n)``.")
    return rnn


_PACKED = (
    "nn.{kind} at '{module}' was called with a PackedSequence; quantlens decomposes recurrent layers into their gate "
    "ops step by step and supports padded tensors only. Pass the padded tensor (batch_first either way) instead."
)


def _scope(tracer: ForwardTracer, sub: str) -> str:
    module = tracer.module_stack[-1]
    return f"{module}.{sub}" if module and sub else (module or sub)


def _direction(tracer, step, steps, time_dim, state, scope, order) -> list[list]:
    """One layer in one direction: the state after each time step of ``order``. Each step runs in a fresh
    ``scope`` (one set of op sites for all steps) and selects its input there; export traces three steps and
    folds the rest (``rnn_fold.py``)."""

    def run(t, state):
        with tracer.fresh_scope(scope):
            return step(steps.select(time_dim, t) if isinstance(steps, torch.Tensor) else steps[t], state)

    if folds(tracer, len(order), state):
        return run_folded(tracer, run, order, state, [] if isinstance(steps, torch.Tensor) else
                          [steps[t] for t in order[1:]])
    after = []
    for t in order:
        state = run(t, state)
        after.append(state)
    return after


def _sequence(tracer, kind, input, states, params, has_biases, num_layers, dropout, train, bidirectional,
              batch_first):
    """All layers and directions of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, layer by layer, each unrolled over time."""
    directions = 2 if bidirectional else 1
    per_layer = len(params) // (num_layers * directions)
    time_dim = 1 if batch_first else 0
    # a layer's input: a tensor (selected step by step inside the step scope) or the previous layer's steps
    steps: torch.Tensor | list = input
    length = input.shape[time_dim]
    finals: list[list[Any]] = [[] for _ in states]
    for layer in range(num_layers):
        sequences = []
        for direction in range(directions):
            index = layer * directions + direction
            weights = list(params[index * per_layer:(index + 1) * per_layer])
            w_ih, w_hh = weights[0], weights[1]
            b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
            w_hr = weights[4 if has_biases else 2] if kind == "lstm" and len(weights) > (4 if has_biases else 2) \
                else None
            state = [s[index] for s in states]
            scope = _scope(tracer, f"l{layer}" + ("_reverse" if direction else ""))
            drop = dropout if train and layer > 0 else 0.0

            def step(x, state, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, w_hr=w_hr, drop=drop):
                if drop:
                    x = F.dropout(x, drop, training=True)
                if kind == "lstm":
                    return list(_lstm_step(x, state[0], state[1], w_ih, w_hh, b_ih, b_hh, w_hr))
                if kind == "gru":
                    return [_gru_step(x, state[0], w_ih, w_hh, b_ih, b_hh)]
                return [_rnn_step(x, state[0], w_ih, w_hh, b_ih, b_hh, relu=kind == "rnn_relu")]

            order = list(range(length)) if direction == 0 else list(reversed(range(length)))
            after = _direction(tracer, step, steps, time_dim, state, scope, order)
            out = [None] * length
            for t, state in zip(order, after):
                out[t] = state[0]
            for final, value in zip(finals, state):
                final.append(value)
            sequences.append(out)
        if directions == 1:
            steps = sequences[0]
        elif layer + 1 < num_layers:
            steps = torch.cat([torch.stack(sequences[0], time_dim), torch.stack(sequences[1], time_dim)], -1)
    if directions == 1:
        output = torch.stack(steps, time_dim)
    else:
        output = torch.cat([torch.stack(sequences[0], time_dim), torch.stack(sequences[1], time_dim)], -1)
    return (output, *(torch.stack(f, 0) if len(f) > 1 else f[0].unsqueeze(0) for f in finals))


#: canonical op name of a fused torch function -> its decomposition ``fn(tracer, *args, **kwargs)``; the tracer
#: runs it (with itself active) instead of the function, for the op types that ``quantlens.march.opset`` declares
#: ``COMPOSITE``.
DECOMPOSED_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "lstm": lstm,
    "gru": gru,
    "rnn_tanh_cell": _rnn_cell(relu=False),
    "rnn_relu_cell": _rnn_cell(relu=True),
    "rnn_tanh": _rnn(relu=False),
    "rnn_relu": _rnn(relu=True),
    **NORM_DECOMPOSED_FUNCTIONS,  # group_norm, instance_norm, glu (norm_decompositions.py)
    **GEMM_DECOMPOSED_FUNCTIONS,  # baddbmm (gemm_decompositions.py)
}
