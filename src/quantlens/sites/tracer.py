"""Op sites: naming every operation of an eager model, while the user's own ``forward`` runs.

The tracer is a ``torch.overrides.TorchFunctionMode`` (for torch functions, ``torch.nn.functional`` calls and
tensor methods) plus global module forward hooks (for module calls). It assigns every op that touches a float
tensor an **op site name** and hands the call to a *handler*; handlers record (``prepare``), quantize (the
prepared model) or dump tensors (the profiler). The name rule (also in ``docs/architecture.md``):

* a module listed in :mod:`quantlens.sites.op_rules` (conv, linear, layernorm, QuantStub ...) is one
  op site named by its qualified name, e.g. ``backbone.conv1``; its k-th call (k >= 1) in the same forward is
  ``backbone.conv1@k`` (a shared module);
* any other op is ``<enclosing module>.<op>_<k>``, e.g. ``backbone.layer1.0.add_0``, where ``<op>`` is the
  canonical op name (``x + y``, ``torch.add`` and ``x.add`` are all ``add``) and ``k`` counts that op in that
  module during this forward; at the root module the prefix is empty (``add_0``).

Ops whose inputs include no float tensor (shape arithmetic, masks, index math) and metadata queries get no
name, so they cannot shift the numbering of the ops that matter.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils import _pytree as pytree

from quantlens.march.semantics import MARCH_FUNCTIONS
from quantlens.sites.op_rules import (
    OpKind,
    OpRule,
    canonical_op_name,
    function_rule,
    is_recurrent_module,
    module_rule,
)
from quantlens.sites.rnn import DECOMPOSED_FUNCTIONS
from quantlens.sites.source_location import TORCH_DIR, is_within, user_source_location
from quantlens.sites.tracing_state import enter_traced_forward, leave_traced_forward

__all__ = ["SiteCall", "SiteHandler", "OpSiteTracer", "module_qualnames", "float_tensor_leaves", "user_source_location", "is_within",
           "TORCH_DIR", "TensorMarks"]

def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def float_tensor_leaves(args: tuple, kwargs: dict) -> tuple[list, Any, list[int]]:
    """Flatten (args, kwargs); return the leaves, the spec, and the leaf positions of float tensors."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_float_tensor(leaf)]
    return leaves, spec, positions



INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__imatmul__"}


def is_inplace(func) -> bool:
    """``Tensor.add_``, ``Tensor.__iadd__`` ... (``torch.relu_``-style functions too)."""
    name = getattr(func, "__name__", "")
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


class TensorMarks:
    """A side table ``tensor -> value`` owned by one forward (the producer of a tensor, its fake quant).

    Nothing is attached to the tensors themselves: the user's inputs and outputs leave a forward exactly as
    they came (they pickle, deep-copy and ``torch.load(weights_only=True)`` as before). Entries are keyed by
    ``id(tensor)`` and hold a weak reference to the tensor, so a lookup only answers for the very object that
    was marked (an id reused by a later tensor finds the dead reference and answers ``default``), and the table
    keeps no activation alive. :meth:`clear` ends the forward.
    """

    __slots__ = ("_table", "__weakref__")

    def __init__(self):
        self._table: dict[int, tuple[Any, Any]] = {}

    def get(self, tensor: Any, default: Any = None) -> Any:
        entry = self._table.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return default
        return entry[1]

    def __contains__(self, tensor: Any) -> bool:
        entry = self._table.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def set(self, tensor: torch.Tensor, value: Any) -> None:
        key = id(tensor)
        table_ref = weakref.ref(self)

        def forget(ref, key=key):  # the tensor died: drop its entry unless the id was marked again since
            table = table_ref()
            if table is not None and table._table.get(key, (None,))[0] is ref:
                del table._table[key]

        self._table[key] = (weakref.ref(tensor, forget), value)

    def clear(self) -> None:
        self._table.clear()

    def __len__(self) -> int:
        return len(self._table)


@dataclass
class SiteCall:
    """One execution of an op site."""

    name: str
    rule: OpRule
    module_name: str  # the module itself for module sites, the enclosing module for function ops
    module: nn.Module | None = None  # set for module sites
    func: Callable | None = None  # set for function ops
    #: inside a recurrent layer: the site runs once per call or time step, from whichever line calls the layer
    repeated: bool = False

    @property
    def is_module(self) -> bool:
        return self.module is not None


class SiteHandler:
    """What to do at each op site. The default runs the op unchanged."""

    #: whether :meth:`follow` wants the ops that are no op site (integer only): a profiler run that names the op
    #: site an index came from
    follows_values = False

    def follow(self, args: tuple, kwargs: dict, output: Any) -> None:
        """An op that is no op site ran (only called while :attr:`follows_values`)."""

    def function_op(self, site: SiteCall, func: Callable, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def module_enter(self, site: SiteCall, args: tuple) -> tuple | None:
        return None

    def module_exit(self, site: SiteCall, args: tuple, output: Any) -> Any:
        return None


@dataclass
class _Frame:
    kind: str  # "container", "leaf", "skip"
    site: SiteCall | None = None
    args: tuple = ()
    annotation: Any = None
    recurrent: bool = False  # a recurrent module's container frame


def module_qualnames(root: nn.Module) -> dict[int, str]:
    """``id(module) -> qualified name`` of every module of ``root`` (its first name where one is shared)."""
    names: dict[int, str] = {}
    for name, mod in root.named_modules(remove_duplicate=True):
        names.setdefault(id(mod), name)
    return names


class OpSiteTracer(TorchFunctionMode):
    """Names op sites of ``root`` during one forward and dispatches them to ``handler``.

    Use as ``with OpSiteTracer(model, handler): model(*inputs)``; each ``with`` is one forward pass, and call
    indices restart at zero.

    While ``OpSiteTracer.annotate_sites`` is true (set by ``quantlens.compiler.export``), every torch op run for
    a site is tagged ``node.meta["custom"]["op_site"]`` in a ``torch.export`` graph: the debug handle that
    carries op site names into the IR.
    """

    annotate_sites = False

    def __init__(self, root: nn.Module, handler: SiteHandler, qualnames: dict[int, str] | None = None,
                 export_branch: bool = True):
        """``qualnames`` (``id(module) -> name``, as :func:`module_qualnames` gives it): for a caller that runs many
        forwards of a model nobody restructures meanwhile (sensitivity's ablations); made here otherwise.
        ``export_branch=False`` leaves ``torch.compiler.is_exporting()`` as it is: the forward takes the branch the
        user's own eager run takes (the profiler's check that the float model it traces is the one the user runs)."""
        super().__init__()
        self.export_branch = export_branch
        self.root = root
        self.handler = handler
        self.qualnames = qualnames if qualnames is not None else module_qualnames(root)
        self._by_state: dict[int, str] | None = None  # id(module.__dict__) -> name, made on a proxy's first call
        self._reset()

    def _reset(self) -> None:
        self.counters: dict[tuple[str, str], int] = defaultdict(int)
        self.module_stack: list[str] = [""]
        self.frames: list[_Frame] = []
        self.leaf_depth = 0
        self.internal = 0
        self.recurrent_depth = 0  # recurrent modules (LSTM, GRU cells) on the module stack

    # -- entering / leaving -------------------------------------------------------------------------------
    def __enter__(self):
        self._reset()
        self._handles = [
            _module_hooks.register_module_forward_pre_hook(self._pre_hook),
            _module_hooks.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        # Libraries branch on torch.compiler.is_compiling() / is_exporting() (transformers builds its attention
        # masks another way under torch.export), so every traced forward takes export's branch: the op sites
        # prepare records are the ones export meets, and calibration observes the ops the IR will run.
        # (quantlens' own code asks tracing_state.export_tracing() for the real answer)
        self._saved_flags = enter_traced_forward() if self.export_branch else None
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        if self._saved_flags is not None:
            leave_traced_forward(self._saved_flags)
        return super().__exit__(*exc)

    # -- function ops ---------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.leaf_depth or self.internal:
            return func(*args, **kwargs)
        op = canonical_op_name(func)
        rule = function_rule(op)
        if rule.kind is OpKind.IGNORED or not _has_float_tensor(args, kwargs):
            out = func(*args, **kwargs)
            if self.handler.follows_values:
                self.handler.follow(args, kwargs, out)
            return out
        if op in MARCH_FUNCTIONS and not is_inplace(func):  # the march's answer (march/semantics.py): topk /
            func = MARCH_FUNCTIONS[op]  # sort's tie order, 0 / 0 (docs/march.md §11.1, §13.5), at every stage
        if rule.kind is OpKind.COMPOSITE:
            decomposition = DECOMPOSED_FUNCTIONS.get(op)
            if decomposition is not None:  # a fused torch op (_VF.lstm ...): run its Python decomposition
                return _run_decomposition(self, decomposition, args, kwargs)
            return _run_inside(self, func, args, kwargs)
        module_name = self.module_stack[-1]
        index = self.counters[(module_name, op)]
        self.counters[(module_name, op)] = index + 1
        name = f"{module_name}.{op}_{index}" if module_name else f"{op}_{index}"
        site = SiteCall(name=name, rule=rule, module_name=module_name, func=func, repeated=self.recurrent_depth > 0)
        self.internal += 1
        annotation = _annotation(name)
        try:
            with annotation:
                return self.handler.function_op(site, func, args, kwargs)
        finally:
            self.internal -= 1

    @contextlib.contextmanager
    def fresh_scope(self, name: str):
        """Ops run inside are named ``<name>.<op>_<k>``, ``k`` counted from 0 again at every entry: the time steps
        of a recurrent layer reuse one set of op sites, and so one set of quantizers (``rnn.py``)."""
        self._restart_counters(name)
        self.module_stack.append(name)
        try:
            yield
        finally:
            self.module_stack.pop()

    def _restart_counters(self, scope: str) -> None:
        for key in [k for k in self.counters if not scope or k[0] == scope or k[0].startswith(scope + ".")]:
            del self.counters[key]

    # -- module calls ----------------------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple):
        if self.leaf_depth or self.internal:
            self.frames.append(_Frame("skip"))
            return None
        qualname = self.qualnames.get(id(module))
        if qualname is None:
            qualname = self._proxied_qualname(module)
        if qualname is None:  # a module outside the traced model: its ops belong to the enclosing module
            self.frames.append(_Frame("skip"))
            return None
        rule = module_rule(module)
        if rule is None:  # a container or an unknown module: trace the ops of its forward one by one
            recurrent = is_recurrent_module(module)
            self.frames.append(_Frame("container", recurrent=recurrent))
            self.module_stack.append(qualname)
            if recurrent:  # every call (time step) reuses the same op sites (rnn.py)
                self._restart_counters(qualname)
                self.recurrent_depth += 1
            return None
        index = self.counters[(qualname, "<module>")]
        self.counters[(qualname, "<module>")] = index + 1
        name = qualname if index == 0 else f"{qualname}@{index}"
        site = SiteCall(name=name, rule=rule, module_name=qualname, module=module)
        annotation = _annotation(name)
        annotation.__enter__()  # left in _post_hook: the whole module call belongs to this site
        self.internal += 1
        try:
            new_args = self.handler.module_enter(site, args)
        finally:
            self.internal -= 1
        self.frames.append(_Frame("leaf", site, args if new_args is None else new_args, annotation))
        self.leaf_depth += 1
        return new_args

    def _proxied_qualname(self, module: nn.Module) -> str | None:
        """The name of the model's module that ``module`` stands in for: torch.export (non-strict) calls a proxy in
        place of each module of a model where one module is registered under two names; the proxy shares the
        module's ``__dict__``, its state (``torch.fx.experimental.proxy_tensor._ModuleStackTracer``)."""
        if self._by_state is None:
            self._by_state = {id(m.__dict__): self.qualnames[id(m)] for m in self.root.modules()
                              if id(m) in self.qualnames}
        return self._by_state.get(id(module.__dict__))

    def _post_hook(self, module: nn.Module, args: tuple, output: Any):
        if not self.frames:
            return None
        frame = self.frames.pop()
        if frame.kind == "container":
            self.module_stack.pop()
            self.recurrent_depth -= frame.recurrent
            return None
        if frame.kind == "skip":
            return None
        self.leaf_depth -= 1
        self.internal += 1
        try:
            return self.handler.module_exit(frame.site, frame.args, output)
        finally:
            self.internal -= 1
            frame.annotation.__exit__(None, None, None)


def _run_inside(mode: "OpSiteTracer", func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a composite ``torch.nn.functional`` function with the mode active, so its own ops are op sites.

    Such a function starts with ``if has_torch_function(...): return handle_torch_function(...)``; with the mode
    active that check would send it straight back here. The module-global ``has_torch_function`` it reads is
    answered ``False`` once (that first check only) and restored at once.
    """
    module = sys.modules[func.__module__]
    original = module.has_torch_function

    def first_check_passes(*_):
        module.has_torch_function = original
        return False

    module.has_torch_function = first_check_passes
    _push_mode(mode)
    try:
        return func(*args, **kwargs)
    finally:
        _pop_mode()
        module.has_torch_function = original


def _run_decomposition(mode: "OpSiteTracer", decomposition: Callable, args: tuple, kwargs: dict) -> Any:
    """Run the Python decomposition of a fused torch op with the mode active, so its ops are op sites."""
    _push_mode(mode)
    try:
        return decomposition(mode, *args, **kwargs)
    finally:
        _pop_mode()


#: one no-op context for every site call when sites are not annotated (nullcontext is reusable and reentrant)
_NO_ANNOTATION = contextlib.nullcontext()


def _annotation(name: str):
    if OpSiteTracer.annotate_sites:
        import torch.fx.traceback as fx_traceback

        return fx_traceback.annotate({"op_site": name})
    return _NO_ANNOTATION


def _has_float_tensor(args: tuple, kwargs: dict) -> bool:
    for a in args:
        if is_float_tensor(a):
            return True
        if isinstance(a, (list, tuple)) and any(is_float_tensor(x) for x in a):
            return True
    return any(is_float_tensor(v) for v in kwargs.values())
