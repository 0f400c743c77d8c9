"""Recording the op sites of a float model: names, types, data flow, shapes and source lines.

``prepare`` records the float model on every example input; fusion, qconfig templates and the check report all
work from the returned :class:`ModelRecord`. :func:`get_op_sites` exposes the same record to users and the
profiler (op site names are identical in the float and the prepared model).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.march.opset import op_def
from quantlens.sites.op_rules import OpKind
from quantlens.sites.source_location import TORCH_DIR, is_within
from quantlens.sites.tracer import (
    OpSiteTracer,
    SiteCall,
    SiteHandler,
    TensorMarks,
    float_tensor_leaves,
    is_float_tensor,
    user_source_location,
)

__all__ = ["SiteInput", "OpSiteRecord", "ModelRecord", "record_model", "call_model", "model_device",
           "inputs_to"]



@dataclass
class SiteInput:
    """One float tensor input of an op site (position among the call's float tensor leaves)."""

    position: int
    producer: str | None  # op site that produced it; None for model inputs and constants
    is_parameter: bool
    shape: tuple[int, ...]
    #: the tensor is one of the model's float inputs (as the caller passed it); with no producer and not this, it
    #: was made inside ``forward`` (a buffer, a constant, ``ones_like``, a cast of an integer mask)
    from_input: bool = False


@dataclass
class OpSiteRecord:
    """Everything known about one op site after recording."""

    name: str
    op_type: str
    kind: OpKind
    module_name: str
    module_type: str | None  # class name for module sites
    is_module: bool
    known: bool
    gemm: bool
    boundary: str
    weight_args: tuple[int, ...]
    bias_args: tuple[int, ...]
    output_from_weight: bool
    index_producing: bool
    inputs: list[SiteInput]
    output_shapes: list[tuple[int, ...]]
    source: str
    calls: int = 1
    #: computes on data that already left the NPU through a DeQuantStub (float post-processing on the host)
    after_dequant: bool = False
    #: computes only on values made inside ``forward`` (constants, buffers, ``arange`` / ``*_like`` results, casts
    #: of integer masks or positions): no model input and no weight reaches it, so it is no part of the integer
    #: region (it runs on the host, or export folds it into a constant)
    made_inside: bool = False


@dataclass
class ModelRecord:
    """Op sites in first-execution order, with their data flow."""

    sites: dict[str, OpSiteRecord] = field(default_factory=dict)
    module_calls: Counter = field(default_factory=Counter)
    num_examples: int = 0

    def consumers(self, name: str) -> list[str]:
        return [s.name for s in self.sites.values() if any(i.producer == name for i in s.inputs)]

    def origin(self, name: str) -> str | None:
        """Follow passthrough sites back to the site that computed the values (None: a model input)."""
        seen = set()
        while name is not None and name not in seen:
            seen.add(name)
            site = self.sites[name]
            if site.kind is not OpKind.PASSTHROUGH or site.boundary:
                return name
            data = [i for i in site.inputs if not i.is_parameter]
            name = data[0].producer if data else None
        return None

    def feeds_only_dequant(self, name: str) -> bool:
        """True when every use of the site's output, through passthrough ops that keep the channel dim whole
        (a per-channel int32 output passes them: ``OpDef.carries_channels``), ends in a DeQuantStub."""
        stack, seen = list(self.consumers(name)), set()
        if not stack:
            return False
        while stack:
            consumer = stack.pop()
            if consumer in seen:
                continue
            seen.add(consumer)
            site = self.sites[consumer]
            if site.boundary == "output":
                continue
            op = op_def(site.op_type)
            if site.kind is not OpKind.PASSTHROUGH or op is None or not op.carries_channels:
                return False
            nxt = self.consumers(consumer)
            if not nxt:
                return False  # a model output that is not dequantized explicitly
            stack.extend(nxt)
        return True


class _Recorder(SiteHandler):
    def __init__(self, record: ModelRecord, model_inputs: TensorMarks | None = None):
        self.record = record
        #: which op site produced each tensor, for this one forward (nothing is attached to the tensors)
        self.marks = TensorMarks()
        #: the model's float input tensors of this forward
        self.model_inputs = model_inputs if model_inputs is not None else TensorMarks()
        #: views of parameters made by movement ops (``weight.unsqueeze(1)`` passed to ``F.conv1d``): weights too
        self.param_views = TensorMarks()

    def _inputs(self, site: SiteCall, args: tuple, kwargs: dict) -> list[SiteInput]:
        leaves, _, positions = float_tensor_leaves(args, kwargs)
        result = []
        for pos in positions:
            t = leaves[pos]
            producer = self.marks.get(t)
            result.append(SiteInput(pos, producer, isinstance(t, nn.Parameter) or t in self.param_views,
                                    tuple(t.shape), from_input=producer is None and t in self.model_inputs))
        return result

    def _mark_outputs(self, name: str, output: Any) -> list[tuple[int, ...]]:
        shapes = []
        for leaf in _output_leaves(output):
            if is_float_tensor(leaf):
                self.marks.set(leaf, name)
                shapes.append(tuple(leaf.shape))
        return shapes

    def _add(self, site: SiteCall, inputs: list[SiteInput], shapes: list[tuple[int, ...]]) -> None:
        existing = self.record.sites.get(site.name)
        if existing is not None:
            existing.calls += 1
            source = user_source_location()
            moved = existing.source != source and not site.repeated  # a recurrent layer's ops: any calling line
            if existing.op_type != site.rule.op_type or moved:
                raise QuantLensError(
                    f"Op site '{site.name}' ran from {existing.source} ({existing.op_type}) on one example input "
                    f"and from {source} ({site.rule.op_type}) on another. Python control flow in module "
                    f"'{site.module_name or '<root>'}' changes the order of its ops between inputs, so one name "
                    "would mean two different ops. Move each branch into its own submodule so every op keeps a "
                    "stable name."
                )
            return
        rule = site.rule
        self.record.sites[site.name] = OpSiteRecord(
            name=site.name,
            op_type=rule.op_type,
            kind=rule.kind,
            module_name=site.module_name,
            module_type=type(site.module).__name__ if site.module is not None else None,
            is_module=site.is_module,
            known=rule.known,
            gemm=rule.gemm,
            boundary=rule.boundary,
            weight_args=rule.weight_args,
            bias_args=rule.bias_args,
            output_from_weight=rule.output_from_weight,
            index_producing=rule.index_producing,
            inputs=inputs,
            output_shapes=shapes,
            source=user_source_location(),
        )

    def function_op(self, site, func, args, kwargs):
        inputs = self._inputs(site, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not getattr(func, "__name__", "").endswith("_") and any(
                a is out for a in args):
            # x.to(x.dtype), x.contiguous(): torch hands back x itself. x keeps its producer, as the runtime's
            # fake-quantized copy never reaches the other readers of x (a mask cast in every layer)
            self._add(site, inputs, [tuple(out.shape)] if is_float_tensor(out) else [])
            return out
        self._add(site, inputs, self._mark_outputs(site.name, out))
        if site.rule.kind is OpKind.PASSTHROUGH and inputs and all(i.is_parameter for i in inputs):
            for leaf in _output_leaves(out):  # a view of a weight is still the weight
                if is_float_tensor(leaf):
                    self.param_views.set(leaf, True)
        return out

    def module_enter(self, site, args):
        self.record.module_calls[site.module_name] += 1
        return None

    def module_exit(self, site, args, output):
        inputs = self._inputs(site, args, {})
        self._add(site, inputs, self._mark_outputs(site.name, output))
        return None


def _output_leaves(output: Any) -> list:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, tuple) and not hasattr(output, "_fields") and type(output) is not tuple:
        return [x for x in output if isinstance(x, torch.Tensor)]  # torch.return_types structseq
    return pytree.tree_leaves(output)


def model_device(model: nn.Module) -> torch.device:
    """Where a model runs: the device of its first parameter or buffer (the CPU when it has none)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def inputs_to(example: Any, device: torch.device) -> Any:
    """``example`` with every tensor leaf on ``device`` (the leaves already there as they are, no copy)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.device == device else t.to(device), example)


def call_model(model: nn.Module, example: Any) -> Any:
    """Call ``model`` with one example: a tuple is positional args, anything else is the single argument."""
    if isinstance(example, tuple):
        return model(*example)
    return model(example)


def record_model(model: nn.Module, examples: Iterable[Any]) -> ModelRecord:
    """Run ``model`` (unchanged, no grad) on each example and record its op sites."""
    record = ModelRecord()
    with torch.no_grad():
        for index, example in enumerate(examples):
            model_inputs = TensorMarks()
            for leaf in pytree.tree_leaves(example):
                if is_float_tensor(leaf):
                    model_inputs.set(leaf, True)
            recorder = _Recorder(record, model_inputs)
            try:
                with OpSiteTracer(model, recorder):
                    call_model(model, example)
            except QuantLensError:
                raise
            except Exception as exc:  # (always raised again: the model's own error in words, or this one)
                raise _own_failure(model, example, index, exc) or exc
            finally:
                recorder.marks.clear()
                recorder.param_views.clear()
                model_inputs.clear()
            record.num_examples += 1
    _mark_after_dequant(record)
    _mark_made_inside(record)
    if not record.sites:
        raise QuantLensError(
            f"No float tensor operation ran in {type(model).__name__}.forward on the example inputs; there is "
            "nothing to quantize. Check that example_inputs are the model's real inputs."
        )
    return record


def _own_failure(model: nn.Module, example: Any, index: int, exc: Exception) -> QuantLensError | None:
    """When ``model`` raises the same error on ``example`` without quantlens, that error in words: the model (or
    its example input) is what to fix, not the tracer. ``None`` when the plain call runs."""
    try:
        call_model(model, example)
    except type(exc) as plain:
        frames = [f for f in traceback.extract_tb(plain.__traceback__) if not is_within(f.filename, TORCH_DIR)]
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        return QuantLensError(
            f"The float model {type(model).__name__} raises on example input {index} without quantlens too: "
            f"{type(plain).__name__}: {plain}{where}. prepare records the model by running it; fix the model or "
            "its example inputs so that a plain call model(*example_inputs) runs."
        )
    return None


def _mark_after_dequant(record: ModelRecord) -> None:
    """Sites whose every data input comes from a DeQuantStub or from such sites: host-side post-processing."""
    for site in record.sites.values():
        producers = [i.producer for i in site.inputs if not i.is_parameter and i.producer is not None]
        site.after_dequant = bool(producers) and all(
            record.sites[p].boundary == "output" or record.sites[p].after_dequant for p in producers
        )


def _reads_weights(site: OpSiteRecord) -> bool:
    """A site that computes with the model's weights (a module op, a functional conv/linear/embedding): its
    values belong to the integer region whatever its data inputs are."""
    return site.is_module or site.output_from_weight or any(
        i.is_parameter and i.position in site.weight_args for i in site.inputs)


def _mark_made_inside(record: ModelRecord) -> None:
    """Sites none of whose values depend on a model's float input or a weight (``OpSiteRecord.made_inside``).

    A value depends on the model's inputs when it is one, or when a site that reads one (or a weight, or a
    QuantStub) produced it; the dependence follows every site, host ops included. Iterated to a fixed point, since a
    recurrent cell's steps feed their own earlier sites."""
    dependent: set[str] = set()
    changed = True
    while changed:
        changed = False
        for site in record.sites.values():
            if site.name in dependent:
                continue
            if site.boundary or _reads_weights(site) or any(
                    i.from_input or (i.producer is not None and i.producer in dependent) for i in site.inputs):
                dependent.add(site.name)
                changed = True
    for site in record.sites.values():
        site.made_inside = site.name not in dependent and not site.after_dequant
