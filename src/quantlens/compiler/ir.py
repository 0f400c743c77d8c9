"""The runnable quantlens IR model: :class:`Module`, a :class:`~quantlens.compiler.graph.Graph` with its kind,
its input contract (the exported input pytree, checked at every call) and its output structure.

The data model (nodes, values, constants) lives in :mod:`quantlens.compiler.graph`; its names are re-exported here,
where users have always imported them. ``Module.run`` calls the interpreter, which reads the graph only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens._advice import setting
from quantlens._finite import all_finite
from quantlens.compiler.graph import IR_VERSION, Graph, InputLeaf, KernelFn, Node, ValueInfo
from quantlens.compiler.interpreter import run_graph
from quantlens.compiler.output_containers import load_spec
from quantlens.errors import QuantLensError

__all__ = ["IR_VERSION", "Node", "ValueInfo", "Graph", "Module", "InputLeaf", "KernelFn"]


class Module:
    """A runnable IR model. Call it like the torch model it came from (same input pytree, non-tensor leaves
    equal to the exported ones), or with the tensors alone, by input name: ``module(image=..., meta=...)``.
    Every call checks the tensors against the exported input types first (``docs/ir.md``, "Calling an IR")."""

    def __init__(
        self,
        kind: str,
        graph: Graph,
        input_leaves: list[InputLeaf],
        input_spec: str,
        output_spec: str,
        meta: dict[str, Any] | None = None,
    ):
        if kind not in ("qat", "quantized"):
            raise QuantLensError(f"IR kind must be 'qat' or 'quantized', got {kind!r}.")
        self.kind = kind
        self.graph = graph
        self.input_leaves = input_leaves
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.meta = dict(meta or {})

    @property
    def _high_precision_qpp(self) -> bool:
        """Whether this IR was built for (qat) or with (quantized) the high-precision requantize everywhere:
        consistency level 0 (``quantlens.quantization.ConsistencyStrategy``)."""
        return bool(self.meta.get("high_precision_qpp", False))

    @property
    def consistency_level(self) -> int | None:
        """The consistency level the model was prepared with (``None``: strategy off)."""
        return self.meta.get("consistency_level")

    # -- device ------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the constants (weights, tables, ...) live, and so where the IR runs (CPU when it has none)."""
        for value in self.graph.constants.values():
            if isinstance(value, torch.Tensor):
                return value.device
        return torch.device("cpu")

    def to(self, device: "str | torch.device") -> "Module":
        """Move the constants to ``device`` (in place, like ``nn.Module.to``; returns the module). The simulator
        then runs there: its inputs must be on that device too, and every kernel makes its own constants there
        (same integers on every device: the integer rules use exact arithmetic only)."""
        device = torch.device(device)
        self.graph.constants = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                                for name, value in self.graph.constants.items()}
        return self

    # -- calling -----------------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return list(self.graph.inputs)

    def _feeds_from_call(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        """The named input tensors of one call, in the exported input order. Accepted: the exported structure
        (dicts may list their keys in any order), the deployment format (the same without its non-tensor leaves)
        or the tensors alone by input name. Types are checked by :meth:`run` (:meth:`check_inputs`)."""
        if kwargs and not args and set(kwargs) <= set(self.graph.inputs):
            missing = [n for n in self.graph.inputs if n not in kwargs]
            if missing:
                raise QuantLensError(
                    f"IR model called by input name is missing {missing}; its inputs are {self.graph.inputs}. "
                    f"It expects {self.describe_call()}."
                )
            return {n: kwargs[n] for n in self.graph.inputs}
        expected = pytree.treespec_loads(self.input_spec)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != expected:  # dicts with their keys in another order (specs compare key order)
            leaves, spec = pytree.tree_flatten(_reorder_like((args, kwargs), self._input_tree()))
        if spec != expected:
            deployed_tree = self._deployment_tree()
            call = _reorder_like((args, kwargs), deployed_tree)
            dep_leaves, dep_spec = pytree.tree_flatten(call)
            # the deployment format: the same structure without the non-tensor leaves
            if dep_spec == pytree.tree_flatten(deployed_tree)[1]:
                tensors = iter(dep_leaves)
                leaves = [next(tensors) if info.kind == "tensor" else info.value for info in self.input_leaves]
                spec = expected
        if spec != expected or len(leaves) != len(self.input_leaves):
            raise QuantLensError(
                "The IR model was called with another input structure than at export. It expects "
                f"{self.describe_call()}; it was called as {_describe_given(args, kwargs)}. Call it with the same "
                "structure as at export (dict keys in any order), in the deployment format (the same without the "
                f"values fixed at export), or with the tensors alone by input name: {self._by_name_call()}."
            )
        feeds = {}
        for i, (leaf, info) in enumerate(zip(leaves, self.input_leaves)):
            if info.kind == "tensor":
                if not isinstance(leaf, torch.Tensor):
                    want = _describe_value_info(self.graph.values.get(info.name))
                    raise QuantLensError(
                        f"IR input '{info.name}' must be a tensor ({want}), got {type(leaf).__name__} "
                        f"{leaf!r:.60}. It expects {self.describe_call()}."
                    )
                feeds[info.name] = leaf
            elif not _same_const(leaf, info.value):
                raise QuantLensError(
                    f"Non-tensor input leaf #{i} was {info.value!r} at export and is {leaf!r} now. The IR is "
                    "specialised for the exported value (e.g. the task list picks a branch); export again "
                    f"with this value, or pass the tensors alone by input name. It expects {self.describe_call()}."
                )
        return {n: feeds[n] for n in self.graph.inputs if n in feeds}

    def _input_tree(self) -> Any:
        """The exported ``(args, kwargs)`` with an :class:`InputLeaf` at every leaf."""
        return pytree.tree_unflatten(list(self.input_leaves), pytree.treespec_loads(self.input_spec))

    def _deployment_tree(self) -> Any:
        """:meth:`_input_tree` without its non-tensor leaves (the deployment format)."""
        marker = object()
        tree = pytree.tree_unflatten([leaf if leaf.kind == "tensor" else marker for leaf in self.input_leaves],
                                     pytree.treespec_loads(self.input_spec))
        return _prune(tree, marker)

    def describe_call(self) -> str:
        """The expected call in words: ``module({'image': <tensor 'inputs.image' [1, 3, 16, 16] float32>, ...},
        ['cls'])``, with every value fixed at export written out and marked as such."""
        args, kwargs = self._input_tree()
        parts = [_describe_expected(a, self.graph.values) for a in args]
        parts += [f"{k}={_describe_expected(v, self.graph.values)}" for k, v in kwargs.items()]
        text = f"module({', '.join(parts)})"
        consts = [leaf for leaf in self.input_leaves if leaf.kind == "const"]
        if consts:
            text += " (the non-tensor values are fixed at export: the IR is specialised for them)"
        return text

    def _by_name_call(self) -> str:
        types = {name: _describe_value_info(self.graph.values.get(name)) for name in self.graph.inputs}
        if all(name.isidentifier() for name in types):
            return "module(" + ", ".join(f"{name}=<{t}>" for name, t in types.items()) + ")"
        return "module(**{" + ", ".join(f"{name!r}: <{t}>" for name, t in types.items()) + "})"

    def check_inputs(self, feeds: dict[str, Any], *, check_finite: bool = True) -> None:
        """Refuse named inputs that do not match the exported input types (``graph.values``): a missing input, a
        non-tensor, another rank, another static dim (``-1``, the dynamic batch, takes any size), another dtype
        (exactly the exported one, never converted), a tensor on another device than the module's constants
        (:meth:`to`) and, with ``check_finite``, NaN/Inf in a float input."""
        device = self.device
        for name in self.graph.inputs:
            if name not in feeds:
                raise QuantLensError(
                    f"IR input '{name}' was not given; inputs are {self.graph.inputs}. It expects "
                    f"{self.describe_call()}."
                )
            _check_input(name, feeds[name], self.graph.values.get(name), check_finite=False)
            if feeds[name].device != device:  # (before the finite check: a meta tensor has no values to read)
                raise QuantLensError(
                    f"IR input '{name}' is on {feeds[name].device}, but the IR's constants are on {device}. Move "
                    f"the input (`x.to('{device}')`) or the IR (`module.to('{feeds[name].device}')`).")
            if check_finite:
                _check_finite(name, feeds[name])

    def feeds(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The named input tensors for one call, in any accepted format (the torch input pytree, the deployment
        format, or tensors by input name), checked against the structure the IR was exported with."""
        return self._feeds_from_call(args, kwargs)

    def _deployment_spec(self):
        """The input structure without its non-tensor leaves (seed 2.3.2's deployment format): a task list is
        dropped, a dict loses its non-tensor entries, containers left empty disappear."""
        return pytree.tree_flatten(self._deployment_tree())[1]

    def run(self, feeds: dict[str, torch.Tensor], observer: Callable | None = None, hooks: Any = None, *,
            check_finite: bool | None = None) -> list[torch.Tensor]:
        """Run the graph on named inputs; returns the flat outputs. ``observer(node, inputs, outputs)`` is called
        after every node; ``hooks`` (:class:`~quantlens.compiler.interpreter.RunHooks`) adds per-node kernel
        override and output substitution (the profiler's hooks).

        The inputs are checked against the exported types first (:meth:`check_inputs`). ``check_finite``: refuse
        NaN/Inf in float inputs; ``None`` (default) checks unless the run is instrumented (``observer`` or
        ``hooks``: the profiler's runs, which diagnose non-finite inputs)."""
        from quantlens._threads import loop_threads

        if check_finite is None:
            check_finite = observer is None and hooks is None
        self.check_inputs(feeds, check_finite=check_finite)
        if self.kind != "quantized":  # float kernels: the caller's thread count (it can change the last float bit)
            return run_graph(self, feeds, observer, hooks)
        with loop_threads():  # the simulator's thread count (quantlens._threads); exact whatever the count
            return run_graph(self, feeds, observer, hooks)

    def __call__(self, *args, **kwargs):
        feeds = self._feeds_from_call(args, kwargs)
        flat = self.run(feeds)
        return pytree.tree_unflatten(flat, load_spec(self.output_spec))

    # -- inspection ----------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, int]:
        """Op counts by ``op`` and, for integer ops, ``op[dtype]`` (requantize ops included). A quantized IR also
        reports ``"requantize_ops"`` (requantize applications whose multiplier is not exactly 1) and
        ``"estimated_cycles"`` (batch 1) from :meth:`latency_estimate`."""
        counts: Counter = Counter()
        for node in self.graph.nodes:
            counts[node.op] += 1
            out = self.graph.values.get(node.outputs[0]) if node.outputs else None
            if out is not None and out.qdtype:
                counts[f"{node.op}[{out.qdtype}]"] += 1
        stats = dict(sorted(counts.items()))
        if self.kind == "quantized":
            estimate = self.latency_estimate()
            stats["requantize_ops"] = estimate.requantize_ops
            stats["estimated_cycles"] = estimate.cycles
        return stats

    def latency_estimate(self, batch: int = 1):
        """The march cost model's latency of one call with batch size ``batch`` (quantized IR only):
        :func:`quantlens.compiler.cost.estimate_latency`."""
        from quantlens.compiler.cost import estimate_latency

        return estimate_latency(self, batch)

    def __repr__(self) -> str:
        lines = [f"quantlens IR ({self.kind}), inputs {self.graph.inputs} -> outputs {self.graph.outputs}"]
        lines += [f"  {node!r}" for node in self.graph.nodes]
        return "\n".join(lines)


_EMPTY = object()


def _prune(tree: Any, marker: object) -> Any:
    """``tree`` without the leaves that are ``marker`` (and without containers that end up empty, except the
    top-level (args, kwargs) pair and its args tuple)."""
    def walk(node, top=False):
        if node is marker:
            return _EMPTY
        if isinstance(node, dict):
            kept = {k: walk(v) for k, v in node.items()}
            kept = {k: v for k, v in kept.items() if v is not _EMPTY}
            return kept if kept or top else _EMPTY
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            kept = [v for v in (walk(x) for x in node) if v is not _EMPTY]
            return type(node)(kept) if kept or top else _EMPTY
        return node

    args, kwargs = tree
    return walk(args, top=True), walk(kwargs, top=True)


def _same_const(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


# -- the input contract ----------------------------------------------------------------------------------------
#: how to convert a tensor to an exported input dtype
_CASTS = {"float32": ".float()", "float64": ".double()", "float16": ".half()", "bfloat16": ".bfloat16()",
          "int64": ".long()", "int32": ".int()", "int16": ".short()", "bool": ".bool()"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fmt_shape(shape) -> str:
    return "[" + ", ".join("batch" if d < 0 else str(d) for d in shape) + "]"


def _describe_value_info(info: ValueInfo | None) -> str:
    return "tensor" if info is None else f"tensor {_fmt_shape(info.shape)} {info.dtype}"


def _check_input(name: str, value: Any, info: ValueInfo | None, check_finite: bool) -> None:
    """One named input against its exported type (see :meth:`Module.check_inputs`)."""
    if not isinstance(value, torch.Tensor):
        raise QuantLensError(f"IR input '{name}' must be a {_describe_value_info(info)}, got "
                             f"{type(value).__name__} {value!r:.60}.")
    if info is None:  # a hand-built graph without the input's type: nothing to check against
        return
    want, got = _fmt_shape(info.shape), list(value.shape)
    if value.dim() != len(info.shape):
        hint = (" (a single sample needs the batch dim: `x.unsqueeze(0)`)"
                if value.dim() == len(info.shape) - 1 else "")
        raise QuantLensError(
            f"IR input '{name}' has {value.dim()} dims (shape {got}), but the IR was exported for {len(info.shape)} "
            f"dims: shape {want}, {info.dtype}. Pass a tensor of that rank{hint}."
        )
    bad = [i for i, (d, e) in enumerate(zip(value.shape, info.shape)) if e >= 0 and d != e]
    if bad == [0]:
        raise QuantLensError(
            f"IR input '{name}' has batch {value.shape[0]} (shape {got}), but the IR was exported with a static "
            f"batch of {info.shape[0]} (shape {want}): shapes are fixed at export, as on the NPU. Export with "
            f"{setting('dynamic_batch', True)} to serve any batch size, or call it with batch {info.shape[0]}."
        )
    if bad:
        dims = ", ".join(f"dim {i} is {value.shape[i]}, expected {info.shape[i]}" for i in bad)
        raise QuantLensError(
            f"IR input '{name}' has shape {got}, but the IR was exported for shape {want} ({dims}). Shapes are "
            f"fixed at export (only a dynamic batch, {setting('dynamic_batch', True)}, varies): resize the input "
            "to that shape, or export again with an example of this shape."
        )
    if _dtype_name(value.dtype) != info.dtype:
        cast = _CASTS.get(info.dtype, f".to(torch.{info.dtype})")
        raise QuantLensError(
            f"IR input '{name}' has dtype {_dtype_name(value.dtype)}, but the IR was exported for {info.dtype} "
            f"(shape {want}); it takes exactly that dtype and never converts. Convert it: `x{cast}`."
        )
    if check_finite:
        _check_finite(name, value)


def _check_finite(name: str, value: torch.Tensor) -> None:
    if not all_finite(value):
        nan = int(torch.isnan(value).sum())
        inf = int((~torch.isfinite(value)).sum()) - nan
        raise QuantLensError(
            f"IR input '{name}' holds {nan} NaN and {inf} Inf values (of {value.numel()}). The IR refuses "
            "non-finite inputs: quantizing them gives arbitrary integers (NaN -> 0, Inf -> the saturated "
            "code) and finite, meaningless outputs. Clean the data (e.g. `torch.nan_to_num`), or run it "
            "anyway with `module.run(feeds, check_finite=False)`."
        )


def _reorder_like(given: Any, template: Any) -> Any:
    """``given`` with every plain dict whose keys are those of the matching dict in ``template`` rebuilt in the
    template's key order (pytree specs compare dict key order)."""
    if type(given) is dict and isinstance(template, dict) and set(given) == set(template):
        return {k: _reorder_like(given[k], template[k]) for k in template}
    if type(given) in (list, tuple) and type(template) is type(given) and len(given) == len(template):
        return type(given)(_reorder_like(g, t) for g, t in zip(given, template))
    return given


def _render(node: Any, leaf: Callable[[Any], str]) -> str:
    """A call's input structure in Python-like words; ``leaf`` writes the leaves."""
    if isinstance(node, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v, leaf)}" for k, v in node.items()) + "}"
    if type(node) is list:
        return "[" + ", ".join(_render(v, leaf) for v in node) + "]"
    if type(node) is tuple:
        return "(" + ", ".join(_render(v, leaf) for v in node) + ("," if len(node) == 1 else "") + ")"
    node_def = pytree.SUPPORTED_NODES.get(type(node))
    if node_def is not None:  # a namedtuple or another registered container
        children = node_def.flatten_fn(node)[0]
        return f"{type(node).__name__}(" + ", ".join(_render(v, leaf) for v in children) + ")"
    return leaf(node)


def _describe_expected(node: Any, values: dict[str, ValueInfo]) -> str:
    """One exported argument (a tree of :class:`InputLeaf`): tensors by name and type, fixed values as such."""
    leaves = pytree.tree_leaves(node)
    if leaves and all(isinstance(x, InputLeaf) and x.kind == "const" for x in leaves):
        return repr(pytree.tree_map(lambda x: x.value, node))

    def leaf(x: Any) -> str:
        if isinstance(x, InputLeaf):
            if x.kind == "tensor":
                return f"<{_describe_value_info(values.get(x.name)).replace('tensor', f'tensor {x.name!r}', 1)}>"
            return repr(x.value)
        return repr(x)

    return _render(node, leaf)


def _describe_given(args: tuple, kwargs: dict) -> str:
    def leaf(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"<tensor {list(x.shape)} {_dtype_name(x.dtype)}>"
        text = repr(x)
        return text if len(text) <= 60 else text[:57] + "..."

    parts = [_render(a, leaf) for a in args] + [f"{k}={_render(v, leaf)}" for k, v in kwargs.items()]
    return f"module({', '.join(parts)})"
