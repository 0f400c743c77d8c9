"""What each node of a loaded IR must hold for its kernel to run: its inputs, outputs and required attrs.

Every fact comes from one declaration:

* an IR op whose kernel calls a torch op (``lowering.TORCH_OPS``, the table ops' custom ops): that op's schema. One
  input per tensor argument, in order (``""`` only for an ``Optional[Tensor]``), one or more for a ``Tensor[]``;
  one output per returned tensor; each other argument without a default is a required attr;
* any other IR op (a kernel of its own): ``IROp.inputs`` / ``outputs`` in ``quantlens.march.opset``;
* the attrs a kernel reads beyond its torch op's schema: ``IROp.attrs`` (every IR) and ``IROp.int_attrs`` (its
  integer kernel); and, in a quantized IR off the host, those its ``IROp.cost`` implies (``Cost.requantizes``:
  ``out_dtype``; ``Cost.rescales_each_input``: ``multipliers`` / ``shifts``, one per input);
* ``host_aten``: the schema of the aten overload it names.

:func:`node_problem` returns what is wrong with one node (``None``: nothing), for ``validate`` to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from quantlens.compiler.op_meanings import torch_op_of
from quantlens.march.opset import IR_OPS

__all__ = ["Signature", "signature", "node_problem"]

_REPEATS = "+*"


@dataclass(frozen=True)
class Signature:
    """An op's node shape. ``inputs``: slot names (``name?`` may be ``""``; ``name+`` / ``name*``: one or more / any
    number); ``outputs``: a count, the list attr with one entry per output, or ``None`` (any); ``attrs``: required
    in every IR; ``int_attrs``: required by its integer kernel; ``source``: where the facts come from."""

    inputs: tuple[str, ...]
    outputs: int | str | None
    attrs: tuple[str, ...]
    int_attrs: tuple[str, ...]
    source: str

    def expected_inputs(self) -> str:
        fixed, repeat = _split_slots(self.inputs)
        count = f"{len(fixed)}" if repeat is None else f"{len(fixed) + repeat.endswith('+')} or more"
        return f"{count} input{'' if count == '1' else 's'} ({', '.join(self.inputs) or 'none'})"


def _schema_shape(torch_op) -> tuple[tuple[str, ...], int | None, tuple[str, ...]]:
    """Input slots, output count (``None``: not a fixed count of tensors) and required attrs of a torch op."""
    from quantlens.kernels.integer.aten_call import ATTR_ALIASES

    schema = torch_op._schema
    slots, attrs = [], []
    for arg in schema.arguments:
        kind = str(arg.type)
        if kind in ("Tensor", "Optional[Tensor]"):
            slots.append(arg.name + ("?" if kind != "Tensor" else ""))
        elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
            slots.append(arg.name + ("?+" if "Optional" in kind else "+"))
        elif not arg.has_default_value():
            attrs.append(ATTR_ALIASES.get(arg.name, arg.name))
    returns = [str(r.type) for r in schema.returns]
    outputs = len(returns) if all(r == "Tensor" for r in returns) else None
    return tuple(slots), outputs, tuple(attrs)


@lru_cache(maxsize=None)
def signature(op: str) -> Signature:
    """The node shape of IR op ``op`` (an op of ``IR_OPS``)."""
    spec = IR_OPS[op]
    if spec.inputs is not None:
        outputs = 1 if spec.outputs is None else None if spec.outputs == "*" else spec.outputs
        sig = Signature(spec.inputs, outputs, spec.attrs, spec.int_attrs, "quantlens.march.opset")
    else:
        torch_op = torch_op_of(op)  # (the schema of the op its qat kernel calls gives the node shape)
        if torch_op is None:
            raise LookupError(f"IR op {op!r} declares no inputs in quantlens.march.opset and has no torch op")
        slots, outputs, attrs = _schema_shape(torch_op)
        sig = Signature(slots, outputs, tuple(dict.fromkeys(attrs + spec.attrs)), spec.int_attrs,
                        f"the schema of {torch_op._schema.name}")
    if any(slot[-1] in _REPEATS for slot in sig.inputs[:-1]):
        raise LookupError(f"IR op {op!r}: only its last input may repeat ({sig.inputs})")
    return sig


def _split_slots(slots: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """The fixed slots and the repeated last one (``None``: none repeats)."""
    if slots and slots[-1][-1] in _REPEATS:
        return slots[:-1], slots[-1]
    return slots, None


def _input_problem(sig: Signature, inputs: list[str]) -> str | None:
    fixed, repeat = _split_slots(sig.inputs)
    minimum = len(fixed) + (repeat is not None and repeat.endswith("+"))
    if len(inputs) < minimum or (repeat is None and len(inputs) > len(fixed)):
        return f"has {len(inputs)} input{'' if len(inputs) == 1 else 's'}, expected {sig.expected_inputs()}"
    for i, name in enumerate(inputs):
        slot = fixed[i] if i < len(fixed) else repeat
        if not name and "?" not in slot:
            return (f"input {i} ({slot.rstrip(_REPEATS)}) is absent (\"\"), and its kernel needs it; expected "
                    f"{sig.expected_inputs()}, '?' marking the optional ones")
    return None


def _host_aten_problem(attrs: dict, n_inputs: int, n_outputs: int) -> str | None:
    """A ``host_aten`` node names an aten overload of this torch, its recorded arguments fit that overload's
    schema, it reads each of its inputs, and it has one output per tensor the overload returns."""
    from quantlens.compiler.host_ops import aten_overload
    from quantlens.errors import QuantLensError

    target = attrs["target"]
    try:
        schema = aten_overload(target, "")._schema if isinstance(target, str) else None
    except QuantLensError:
        schema = None
    if schema is None:
        return f"names {str(target)[:80]!r}, expected an aten or prims operator of this torch"
    args, kwargs = attrs["args"], attrs["kwargs"]
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return "has attrs args / kwargs that are not a list / an object"
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = {a.name for a in schema.arguments}
    if len(args) > len(positional) or set(kwargs) - names:
        return (f"passes {len(args)} arguments and the keywords {sorted(map(str, kwargs))[:5]} to {schema.name}, "
                f"whose schema takes {len(positional)} positional arguments and the names {sorted(names)}")
    given = {a.name for a in positional[:len(args)]} | set(kwargs)
    missing = [a.name for a in schema.arguments if a.name not in given and not a.has_default_value()]
    if missing:
        return f"does not pass the arguments {missing} that {schema.name} requires"
    used = _input_refs([args, kwargs])
    if used != set(range(n_inputs)):
        return (f"has {n_inputs} inputs and its arguments read the inputs {sorted(used)[:8]}, expected each of "
                f"0..{n_inputs - 1} (every input read, no other)")
    returns = [str(r.type) for r in schema.returns]
    if all(r == "Tensor" for r in returns) and n_outputs != len(returns):
        return f"has {n_outputs} outputs, expected {len(returns)} (the tensors {schema.name} returns)"
    return None


def _input_refs(value: Any) -> set:
    """The input indices ``{"input": i}`` a host op's recorded arguments read (a non-int index reads as -1)."""
    if isinstance(value, dict):
        if set(value) == {"input"}:
            i = value["input"]
            return {i if type(i) is int else -1}
        return set().union(*(_input_refs(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_input_refs(v) for v in value)) if value else set()
    return set()


def node_problem(op: str, inputs: list[str], outputs: list[str], attrs: dict, kind: str) -> str | None:
    """What keeps a node of IR op ``op`` (in a module of ``kind``) from running, as the end of a sentence that
    starts with the node (``"has 3 inputs, expected 1 input (self)"``); ``None`` when nothing does."""
    spec = IR_OPS[op]
    sig = signature(op)
    problem = _input_problem(sig, inputs)
    if problem:
        return problem
    runtime = attrs.get("runtime") is not None  # a runtime march's kernel (March.ORT_CPU): its own parameters
    integer = kind == "quantized" and attrs.get("host") is not True and spec.level != "qat" and not runtime
    required = sig.attrs + (sig.int_attrs if integer else ()) + (("zero_points",) if runtime else ())
    per_input: tuple[str, ...] = ()
    if integer and spec.cost.requantizes:
        required += ("out_dtype",)
    if integer and spec.cost.rescales_each_input:
        per_input = ("multipliers", "shifts")
    missing = [name for name in required + per_input if name not in attrs]
    if missing:
        return (f"lacks the attrs {missing}, which its {'integer ' if integer else ''}kernel reads (a '{op}' node "
                f"{'of a quantized IR ' if integer else ''}carries {sorted(set(required + per_input))})")
    for name in per_input:
        if not isinstance(attrs[name], list) or len(attrs[name]) != len(inputs):
            return f"has {len(inputs)} inputs and attr {name!r} = {str(attrs[name])[:40]}, expected one entry per input"
    expected = sig.outputs
    if isinstance(expected, str):
        if not isinstance(attrs[expected], list):
            return f"has attr {expected!r} = {str(attrs[expected])[:40]}, expected a list with one entry per output"
        expected = len(attrs[expected])
        what = f"one per entry of its attr {sig.outputs!r}"
    else:
        what = f"from {sig.source}"
    if expected is not None and len(outputs) != expected:
        return f"has {len(outputs)} output{'' if len(outputs) == 1 else 's'}, expected {expected} ({what})"
    if op == "host_aten":
        return _host_aten_problem(attrs, len(inputs), len(outputs))
    return None
