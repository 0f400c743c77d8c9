"""The fake quant of ``docs/march.md`` §5: ``fq(x) = clamp(round_half_to_even(x / s), qmin, qmax) * s`` in float32.

One function computes it (:func:`_fake_quant_math`), reached two ways. Graphs (``torch.export``, ``make_fx``,
``torch.compile``, any dispatch mode or functorch transform) and autograd see the ``torch.library`` custom op
``quantlens::fake_quant``: one node, with the clipped straight-through gradient. A plain eager call that records no
gradient calls the function directly: the op's dispatch (autograd wrapper, redispatch, alias checks) costs about
20 µs a call here, and a third more on a 4 MB activation.
"""

from __future__ import annotations

import torch

from quantlens.march.spec import QuantDType

__all__ = ["fake_quant", "fake_quant_range"]


def broadcast_scale(scale: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A scale shaped to broadcast against ``x``: per tensor, per channel along ``axis``, or a scale of ``x``'s own
    rank as it is (a linear's weight with channel exponents folded in, ``rules.fold_exponents``)."""
    if scale.dim() > 1 and scale.dim() == x.dim():
        return scale
    if axis < 0 or scale.numel() == 1:
        return scale.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return scale.reshape(shape)


def _fake_quant_math(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, axis: int) -> torch.Tensor:
    s = broadcast_scale(scale.to(torch.float32), x, axis)
    # One fresh tensor, then in place: the same arithmetic as quantize() followed by dequantize().
    q = torch.div(x.to(torch.float32), s)
    q.round_().clamp_(qmin, qmax).mul_(s)
    return q.to(x.dtype)


@torch.library.custom_op("quantlens::fake_quant", mutates_args=())
def _fake_quant_op(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, axis: int) -> torch.Tensor:
    return _fake_quant_math(x, scale, qmin, qmax, axis)


@_fake_quant_op.register_fake
def _(x, scale, qmin, qmax, axis):
    return torch.empty_like(x)


def _fake_quant_setup(ctx, inputs, output):
    x, scale, qmin, qmax, axis = inputs
    ctx.save_for_backward(x, scale)
    ctx.qmin, ctx.qmax, ctx.axis = qmin, qmax, axis


def _fake_quant_backward(ctx, grad):
    # Straight-through estimator, clipped: the gradient passes where x lies inside the representable range.
    x, scale = ctx.saved_tensors
    s = broadcast_scale(scale.to(torch.float32), x, ctx.axis)
    inside = (x >= ctx.qmin * s) & (x <= ctx.qmax * s)
    return grad * inside.to(grad.dtype), None, None, None, None


_fake_quant_op.register_autograd(_fake_quant_backward, setup_context=_fake_quant_setup)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, dtype: QuantDType, axis: int | None = None) -> torch.Tensor:
    """Quantize then dequantize ``x`` with a symmetric scale (per-tensor, or per-channel along ``axis``)."""
    return fake_quant_range(x, scale, dtype.qmin, dtype.qmax, -1 if axis is None else axis)


def fake_quant_range(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, axis: int = -1) -> torch.Tensor:
    """:func:`fake_quant` onto the integers ``[qmin, qmax]`` (an IR node's attributes, a bias's int32 range);
    ``axis`` -1: per tensor."""
    if _plain_eager(x, scale):
        with torch._C.DisableTorchFunction():  # one fake quant, not four ops, for a TorchFunctionMode above
            return _fake_quant_math(x, scale, qmin, qmax, axis)
    return torch.ops.quantlens.fake_quant(x, scale, qmin, qmax, axis)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether a fake quant may skip its op: real tensors, no gradient to record, nothing tracing the call."""
    # (a Parameter is a plain tensor too: a weight fake-quantized as the module holds it, transformers' Linear's)
    return (type(x) in _PLAIN and type(scale) in _PLAIN
            and not (torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad))
            and not torch._C._len_torch_dispatch_stack()  # FakeTensorMode / make_fx / torch.export
            and not torch._C._are_functorch_transforms_active()  # vmap / grad wrap plain-typed tensors
            and not torch.compiler.is_dynamo_compiling())
