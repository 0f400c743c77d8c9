"""``export``: capture a prepared (QAT) model with ``torch.export`` and lower it to the qat IR.

The prepared model runs its own ``forward`` under the op-site tracer, in VALIDATION semantics (frozen scales),
with pre_export's table rewrites applied, while ``torch.export`` records the aten ops. Every recorded node carries
its op site name (``node.meta["custom"]["op_site"]``); lowering (``lowering.py``) maps the aten graph to the
documented IR op set and keeps those names.

Non-tensor inputs (e.g. a ``task`` list that picks a branch) are specialised: the IR records their values and
refuses a call with other values.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils import _pytree as pytree

from quantlens._advice import setting
from quantlens.compiler.ir import InputLeaf, Module, ValueInfo
from quantlens.compiler.lowering import decompose_unlowered, lower_exported_program
from quantlens.compiler.output_containers import register_containers_of
from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.kernels import TABLE_OP_IO
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.state import is_prepared
from quantlens.sites.tracer import OpSiteTracer

__all__ = ["export"]


class _FlatCall(nn.Module):
    """Calls the prepared model with a fixed input pytree whose tensor leaves come in as flat arguments."""

    def __init__(self, model: nn.Module, leaves: list, spec, tensor_positions: list[int]):
        super().__init__()
        self.model = model
        self._leaves = leaves
        self._spec = spec
        self._tensor_positions = tensor_positions
        self.output_spec = None

    def forward(self, *tensors):
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_positions, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = self.model(*args, **kwargs)
        flat, self.output_spec = pytree.tree_flatten(out)
        if register_containers_of(flat):  # a library's own container (transformers' cache): its pytree form
            flat, self.output_spec = pytree.tree_flatten(out)
        bad = [type(x).__name__ for x in flat if not isinstance(x, torch.Tensor)]
        if bad:
            raise QuantLensError(
                f"export: the model returns non-tensor values ({bad}); return tensors (in any tuple/list/dict "
                "structure) so the IR can produce them."
            )
        return tuple(flat)


@contextlib.contextmanager
def _capture_state(model: nn.Module):
    """Eval mode, observers off (VALIDATION semantics, no buffer updates in the graph), site annotations on."""
    was_training = model.training
    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    saved = [(m.observe_enabled, m.fake_quant_enabled) for m in fqs]
    model.eval()
    for m in fqs:
        # Weights observe in export's eager pass, so their scales match the current (eval-mode, BatchNorm-folded)
        # weights even right after an optimizer step; torch.export then traces with every observer off.
        m.observe_enabled = m.is_weight
        m.fake_quant_enabled = True
    import torch.fx.traceback as fx_traceback

    # a site annotation some earlier traced forward left open would name this graph's site-less nodes (the mask
    # ops of an attention) after that site: export starts with none, and puts back what it found
    custom = fx_traceback.current_meta.get("custom")
    stale = custom.pop("op_site", None) if isinstance(custom, dict) else None
    OpSiteTracer.annotate_sites = True
    try:
        yield
    finally:
        OpSiteTracer.annotate_sites = False
        # and leaves it as it found it: module-site annotations open in a pre hook and close in a post hook, so on
        # a model whose calls do not nest (a multitask model's two input stubs) torch's annotate can restore a
        # site name after the last one closed
        after = fx_traceback.current_meta.get("custom")
        if isinstance(after, dict):
            after.pop("op_site", None)
            if stale is not None:
                after["op_site"] = stale
        for m, (obs, fq) in zip(fqs, saved):
            m.observe_enabled, m.fake_quant_enabled = obs, fq
        model.train(was_training)


def _input_names(model: nn.Module, args: tuple, kwargs: dict, leaves_paths) -> list[str]:
    """Readable names for tensor inputs from the forward signature: ``inputs.image``, ``input_ids``."""
    try:
        params = list(inspect.signature(type(model).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    names = []
    for path, _ in leaves_paths:
        parts = []
        for i, key in enumerate(path):
            if i == 0:
                continue  # (args, kwargs) level
            if i == 1 and path[0].idx == 0 and hasattr(key, "idx"):
                parts.append(params[key.idx] if key.idx < len(params) else f"arg{key.idx}")
            elif hasattr(key, "key"):
                parts.append(str(key.key))
            elif hasattr(key, "idx"):
                parts.append(str(key.idx))
            elif hasattr(key, "name"):
                parts.append(str(key.name))
        names.append(".".join(parts) or "input")
    seen: dict[str, int] = {}
    unique = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        unique.append(n if seen[n] == 1 else f"{n}_{seen[n] - 1}")
    return unique


def export(
    model: nn.Module, example_inputs: Any, *, apply_pre_export: bool = True, dynamic_batch: bool = False
) -> Module:
    """Export a prepared model (calibrated or QAT-trained) to the qat IR.

    Args:
        model: a model returned by ``quantlens.quantization.prepare`` (or ``pre_export``).
        example_inputs: one call's inputs, as for ``prepare``: a tuple is positional arguments.
        apply_pre_export: apply ``pre_export``'s table rewrites first (default), so the IR computes nonlinear ops
            exactly like ``pre_export(model)``. Ignored when ``model`` already is a pre_export model.
        dynamic_batch: keep dim 0 of every tensor input dynamic, so one IR serves any batch size. Shapes are
            otherwise fixed at the example's, as on the NPU. A batch-1 example is traced on a batch-2 copy
            (torch.export fixes size-1 dims); the IR's batched inputs are checked to have dim 0 = -1, or
            ``QuantLensError`` is raised. Models that compute with the batch size beyond reshapes (e.g. building
            masks with ``arange(batch)``) need the default.
    """
    if not is_prepared(model):
        raise QuantLensError(
            f"export expects a prepared model (quantlens.quantization.prepare), got {type(model).__name__}. "
            "Prepare, calibrate (or train) it, then export."
        )
    from quantlens.quantization.fake_quantize import uncalibrated_message, uncalibrated_sites

    never = uncalibrated_sites(model)
    if never:
        warnings.warn(uncalibrated_message("export", never), stacklevel=2, category=QuantLensWarning)
    if apply_pre_export:
        model = _with_tables(model, example_inputs)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs: dict = {}
    leaves_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in leaves_paths]
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not tensor_positions:
        raise QuantLensError("export: example_inputs contain no tensor; pass the model's real inputs.")
    names = _input_names(model, args, kwargs, leaves_paths)
    input_leaves = [
        InputLeaf("tensor", name=names[i]) if isinstance(leaf, torch.Tensor) else InputLeaf("const", value=leaf)
        for i, leaf in enumerate(leaves)
    ]
    flat_call = _FlatCall(model, leaves, spec, tensor_positions)
    tensors = tuple(leaves[i] for i in tensor_positions)
    traced, batched = (_batch_example(tensors) if dynamic_batch else (tensors, []))
    with _capture_state(model), torch.no_grad():
        eager = flat_call(*tensors)  # eager once: validates the outputs and records their structure
        output_spec = flat_call.output_spec
        for m in model.modules():
            if isinstance(m, FakeQuantize):
                m.observe_enabled = False
        with fx_traceback.preserve_node_meta():  # lets the op-site annotations reach node.meta["custom"]
            dynamic = None
            if dynamic_batch:
                dynamic = (tuple({0: torch.export.Dim.AUTO} if t.dim() > 0 else None for t in traced),)
            try:
                ep = torch.export.export(flat_call, traced, dynamic_shapes=dynamic, strict=False)
            except Exception as exc:
                if traced is tensors:
                    raise
                raise QuantLensError(
                    f"export with {setting('dynamic_batch', True)}: torch.export fixes size-1 dims, so the batch-1 "
                    f"example was traced on a batch-2 copy, and that failed: {exc} If the forward depends on the "
                    f"batch size, export with {setting('dynamic_batch', False)}, or with an example of "
                    "the deployment batch size."
                ) from exc
            # In-place ops (x += y, x.mul_(2), x[:, 0] = 0, clamp_) become their functional forms, and an op with no
            # lowering rule takes torch's own decomposition before lowering refuses it
            ep = decompose_unlowered(ep)
    # The march's partition: host sites (no integer rule, no qconfig, after the DeQuantStub) stay float through
    # convert, and any aten op may be one; so is any aten op the IR has no lowering for (lowering marks those).
    host_sites = frozenset(p.name for p in model._quantlens_state.plans.values() if p.host)
    graph = lower_exported_program(ep, [names[i] for i in tensor_positions], host_sites)
    if dynamic_batch:
        _check_dynamic_batch(graph, [names[tensor_positions[k]] for k in batched])
    for node in graph.nodes:
        if node.site in host_sites:
            node.attrs["host"] = True
    _annotate_table_references(graph, model._quantlens_state)
    module = Module(
        "qat",
        graph,
        input_leaves,
        pytree.treespec_dumps(spec),
        pytree.treespec_dumps(output_spec),
        meta={"march": model._quantlens_state.march, "source_model": type(model).__name__,
              **_variant_meta(model._quantlens_state), **_consistency_meta(model._quantlens_state)},
    )
    if traced is not tensors:  # traced on a batch-2 copy: the IR must also give the example's batch-1 shapes
        _check_batch_one(module, dict(zip(graph.inputs, tensors)), eager)
    return module


def _variant_meta(state) -> dict:
    """A runtime march's kernel variant (``March.ORT_CPU``); QL1's IR has none."""
    variant = getattr(state, "march_variant", None)
    return {} if variant is None else {"march_variant": variant}


def _consistency_meta(state) -> dict:
    """The consistency level the model was prepared with; convert reads ``high_precision_qpp`` (level 0)."""
    config = getattr(state, "consistency", None)
    if config is None:  # a model prepared before the strategy existed
        return {"consistency_level": None, "high_precision_qpp": False}
    return {"consistency_level": config.level, "high_precision_qpp": config.high_precision_qpp}


def _batch_example(tensors: tuple) -> tuple[tuple, list[int]]:
    """The tensors to trace with a dynamic batch, and the positions of those whose dim 0 is the batch.

    torch.export specialises a dim whose example size is 1 (its "0/1 specialisation"; only a log line says so),
    so a batch-1 example would give a static IR. When every tensor input with a dim 0 has size 1 there, the
    model is traced on a batch-2 copy (each such input repeated along dim 0). Otherwise the batch is the
    largest dim 0; inputs with another dim 0 (e.g. a size-1 tensor broadcast over the batch) stay static."""
    sizes = [t.shape[0] for t in tensors if t.dim() > 0]
    if not sizes:
        raise QuantLensError(f"export with {setting('dynamic_batch', True)}: no tensor input has a dim 0 to make "
                             f"dynamic; export with {setting('dynamic_batch', False)}.")
    batch = max(sizes)
    if batch != 1:
        return tensors, [k for k, t in enumerate(tensors) if t.dim() > 0 and t.shape[0] == batch]
    traced = tuple(t.repeat(2, *[1] * (t.dim() - 1)) if t.dim() > 0 else t for t in tensors)
    return traced, [k for k, t in enumerate(tensors) if t.dim() > 0]


def _check_dynamic_batch(graph, batched_names: list[str]) -> None:
    """Every batched input must have a dynamic dim 0 (-1) in the IR, or export raises."""
    static = [name for name in batched_names if graph.values[name].shape[:1] != (-1,)]
    if static:
        shapes = {name: list(graph.values[name].shape) for name in static}
        raise QuantLensError(
            f"export with {setting('dynamic_batch', True)}: torch.export fixed the batch dim (dim 0) of input(s) "
            f"{shapes}: the model "
            "computes with the batch size beyond reshapes (e.g. a reshape to a literal batch, a mask built with "
            "arange(batch), a branch on the batch size), so its graph holds only for that batch. Export with "
            f"{setting('dynamic_batch', False)} (one IR per batch size), or make the forward "
            "batch-agnostic (reshape "
            "with -1 or x.shape[0])."
        )


def _check_batch_one(module: Module, feeds: dict, eager: tuple) -> None:
    """An IR traced on a batch-2 copy must still compute the batch-1 example's output shapes."""
    outputs = module.run(feeds, check_finite=False)
    got = [list(o.shape) for o in outputs]
    want = [list(o.shape) for o in eager]
    # the same ops on the same batch-1 tensors: only a batch-dependent forward differs by more than a few steps
    differs = got != want or any(
        o.is_floating_point() and e.is_floating_point() and e.numel()
        and bool((o - e).abs().max() > 0.1 * e.abs().max() + 1e-6)
        for o, e in zip(outputs, eager)
    )
    if differs:
        raise QuantLensError(
            f"export with {setting('dynamic_batch', True)}: the model was traced on a batch-2 copy of its batch-1 "
            "example (torch.export "
            "fixes size-1 dims), and at batch 1 the IR does not compute what the model computes (output shapes "
            f"{got}, the model's {want}): the forward depends on the batch size (e.g. a branch on batch 1). Export "
            f"with an example of batch 2 or more, or with {setting('dynamic_batch', False)}."
        )


#: table ops whose float op depends on the site (lut: sigmoid, gelu ...), so the node records it
_TABLE_OPS = {name for name, io in TABLE_OP_IO.items() if not io.float_op}


def _annotate_table_references(graph, state) -> None:
    """Record which float op each table op emulates (``attrs["reference"]``), so that a runtime without the
    march's tables (ONNX) can compute the op itself. LayerNorm tables keep their float gamma/beta as constants."""
    from quantlens.quantization.table_overrides import TableOverride

    for node in graph.nodes:
        if node.op not in _TABLE_OPS:
            continue
        plan = state.plans.get(node.site)
        override = state.overrides[plan.override] if plan is not None and plan.override in state.overrides else None
        if not isinstance(override, TableOverride):
            continue
        reference = {"op": override.op_type, **{k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in override.params.items()}}
        for role in ("weight", "bias"):
            ref = getattr(override, f"{role}_ref", None)
            if isinstance(ref, torch.Tensor) and ref.numel():
                name = f"{node.outputs[0]}_reference_{role}"
                graph.constants[name] = ref.detach().clone()
                graph.values[name] = ValueInfo(tuple(ref.shape), "float32")
                reference[role] = name
        node.attrs["reference"] = reference


def _with_tables(model: nn.Module, example_inputs: Any) -> nn.Module:
    """pre_export(model), unless the model already has its tables."""
    from quantlens.quantization.pre_export import lut_sites, pre_export

    if lut_sites(model):
        return model
    return pre_export(model, example_inputs=example_inputs)
