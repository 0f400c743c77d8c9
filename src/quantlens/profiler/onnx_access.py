""":class:`OnnxModelAccess`: the ONNX model written by ``to_onnx``, run by onnxruntime, as the profiler sees it
(the ``onnxruntime`` analysis type: the qat IR against its ONNX file).

**Op sites.** ``to_onnx`` keeps the qat IR's value names as ONNX tensor names for the outputs of IR nodes, so a
site's value (the output of its last IR node, see :mod:`.ir_access`) has the same name in the ONNX graph. The
site -> value-name map comes from the baseline qat IR (:attr:`OnnxModelAccess.reference`, set by
``QuantAnalysis``): every site's value is added as an extra graph output and the whole graph runs once.

**Optimization.** ``optimization`` is onnxruntime's graph optimization level; the default, ``"all"``
(``ORT_ENABLE_ALL``), is what a user's default ``InferenceSession`` runs. ``to_onnx``'s default form dequantizes by
``Cast -> Mul(scale)``, which onnxruntime fuses into no integer kernel, so at every level every op site is traced:
its value is added as a graph output and the graph runs once. ``"disable_all"`` (``ORT_DISABLE_ALL``) runs the graph
as written. Pass the access directly as the analysis model to choose another level::

    QuantAnalysis(qat_ir, OnnxModelAccess("model.onnx", "analysis", optimization="disable_all"), "onnxruntime")

**Outputs check.** A graph output may still block one of onnxruntime's float fusions (a ``Mul`` by a scale folded
into a ``MatMul``, a ``Conv + Relu``), so above ``"disable_all"`` each traced run also runs a plain session of the
same level (model outputs only) and compares its model outputs with the traced session's, bit for bit:
:attr:`OnnxModelAccess.output_check`. When they differ the rows are still the traced session's, and every row's
note says so with the largest difference (nothing is silently replaced).

**Standard QDQ form.** A model written with ``to_onnx(..., standard_qdq=True)`` (``DequantizeLinear``; metadata
``quantlens.onnx_form = standard_qdq``) is fused by onnxruntime into its integer kernels above ``"disable_all"``,
and an intermediate graph output would block those fusions: there only the **model outputs** are fetched, the
trace holds only the sites whose value is a model output (their note says why), and the comparison lists the other
sites as absent (only in the baseline).

**Not offered.** Same-input outputs (a whole-graph session cannot re-run one op on the baseline's inputs) and
sensitivity (onnxruntime's quantizers cannot be switched off one by one): :meth:`quantizers` raises.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from quantlens._threads import num_threads
from quantlens.compiler.output_containers import load_spec
from quantlens.errors import QuantLensError
from quantlens.profiler.model_access import (
    AnalysisType,
    ConsistencyInfo,
    ModelAccess,
    Quantizer,
    SameInputSource,
    TraceSink,
)

__all__ = ["OnnxModelAccess", "OutputCheck", "ORT_LEVELS", "is_onnx_model", "onnx_form"]

#: ``optimization`` -> onnxruntime ``GraphOptimizationLevel`` member
ORT_LEVELS = {"disable_all": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "all": "ORT_ENABLE_ALL"}

SAME_INPUT_NOTE = ("onnxruntime runs the whole graph: same-input needs each op re-run on the baseline's inputs "
                   "(see the 'export' / 'convert' analyses of the IR)")
OUTPUTS_ONLY_NOTE = ("standard QDQ form at {level}: only the model outputs are fetched (a per-op graph output "
                     "would block onnxruntime's integer Q/DQ fusions)")
MISMATCH_NOTE = ("the traced session's model outputs differ from a plain {level} session's (max |diff| {diff:.3g}): "
                 "a per-op graph output blocked a fusion; these values are the traced session's")


@dataclass(frozen=True)
class OutputCheck:
    """The traced session's model outputs against a plain session's at the same level (outputs only)."""

    level: str  # onnxruntime's level name, e.g. "ORT_ENABLE_ALL"
    equal: bool  # bit for bit (NaN equal to NaN)
    max_abs_diff: float  # over every model output (0.0 when equal)

    @property
    def note(self) -> str:
        """The row note when the outputs differ, else ``""``."""
        return "" if self.equal else MISMATCH_NOTE.format(level=self.level, diff=self.max_abs_diff)


def is_onnx_model(model: Any) -> bool:
    """An ``onnx.ModelProto`` or the path of an ``.onnx`` file (checked without importing onnx)."""
    if isinstance(model, (str, os.PathLike)):
        return str(model).lower().endswith(".onnx")
    return type(model).__name__ == "ModelProto" and type(model).__module__.startswith("onnx")


def onnx_form(proto) -> str:
    """``"exact"`` (``Cast -> Mul`` dequantization) or ``"standard_qdq"`` (``DequantizeLinear``): the
    ``quantlens.onnx_form`` metadata ``to_onnx`` writes; for a model without it, ``"standard_qdq"`` when the graph
    has a ``DequantizeLinear`` node (what onnxruntime fuses into integer kernels)."""
    props = {p.key: p.value for p in proto.metadata_props}
    if "quantlens.onnx_form" in props:
        return props["quantlens.onnx_form"]
    return "standard_qdq" if any(n.op_type == "DequantizeLinear" for n in proto.graph.node) else "exact"


def _tensors(names: list[str], arrays: list) -> dict[str, torch.Tensor]:
    # (onnxruntime hands over fresh arrays: no copy unless one is read-only; the trace writer copies anyway)
    return {n: torch.from_numpy(a if a.flags.writeable else a.copy()) if hasattr(a, "flags") else torch.tensor(a)
            for n, a in zip(names, arrays)}


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _imports():
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise QuantLensError("The 'onnxruntime' analysis needs onnx and onnxruntime: pip install 'quantlens[onnx]' "
                             "onnxruntime.") from exc
    return onnx, onnxruntime


def _load_onnx(onnx, path: str, label: str):
    """``onnx.load`` of ``path`` (with its external data), a damaged file or external data refused in words."""
    from google.protobuf.message import DecodeError

    def damaged(what: str) -> QuantLensError:
        return QuantLensError(
            f"QuantAnalysis: the {label} ONNX file '{path}' cannot be read: {what}. Expected an ONNX model as "
            "to_onnx writes it; write it again with to_onnx(qat_ir, path) (the file may be damaged or incomplete).")

    try:
        proto = onnx.load(path)
    except DecodeError as exc:
        raise damaged(f"it is not a valid ONNX protobuf, truncated or damaged ({exc})") from None
    except (onnx.checker.ValidationError, ValueError) as exc:  # onnx's external-data checks
        raise damaged(f"its external data is missing or damaged ({str(exc)[:300]})") from None
    except OSError as exc:
        raise damaged(f"it or its external data cannot be read ({exc.strerror or exc})") from None
    if not proto.graph.node or not proto.opset_import:
        raise damaged("it holds no ONNX graph (an empty file, or not an ONNX model)")
    return proto


class OnnxModelAccess(ModelAccess):
    """An ONNX model (``to_onnx`` of the baseline qat IR; a path or an ``onnx.ModelProto``) run by onnxruntime.

    Args:
        model: the ``.onnx`` path or the ``ModelProto`` (copied; the caller's proto is not changed).
        label: ``"analysis"`` (the role in the analysis).
        optimization: onnxruntime's graph optimization level, one of :data:`ORT_LEVELS`; default ``"all"``
            (``ORT_ENABLE_ALL``, onnxruntime's default). Every op site is traced at every level, except for a
            standard-QDQ model above ``"disable_all"``: model outputs only (see the module docstring).
    """

    kind = "onnx"

    def __init__(self, model: Any, label: str = "analysis", optimization: str = "all"):
        onnx, ort = _imports()
        if optimization not in ORT_LEVELS:
            raise QuantLensError(f"OnnxModelAccess: optimization {optimization!r} is not one of {list(ORT_LEVELS)} "
                                 "(onnxruntime's ORT_DISABLE_ALL, ORT_ENABLE_BASIC, ORT_ENABLE_EXTENDED, "
                                 "ORT_ENABLE_ALL).")
        self.label = label
        self.optimization = optimization
        self.source = ""
        if isinstance(model, (str, os.PathLike)):
            if not os.path.isfile(model):
                raise QuantLensError(f"QuantAnalysis: the {label} ONNX file {str(model)!r} does not exist.")
            self.source = str(model)
            self.proto = _load_onnx(onnx, self.source, label)
        elif is_onnx_model(model):
            self.proto = onnx.ModelProto()
            self.proto.CopyFrom(model)
        else:
            raise QuantLensError(f"OnnxModelAccess expects an onnx.ModelProto or the path of an .onnx file, got "
                                 f"{type(model).__name__}.")
        graph = self.proto.graph
        self.output_names = [o.name for o in graph.output]
        initializers = {i.name for i in graph.initializer}
        self.input_names = [i.name for i in graph.input if i.name not in initializers]
        self._produced = {o for node in graph.node for o in node.output} | set(self.input_names)
        self._ort = ort
        self._sessions: dict[tuple[str, ...], Any] = {}
        #: the baseline qat IR's access (site -> value names, op types, grids); set by QuantAnalysis
        self.reference = None
        #: op sites of the reference whose value has no ONNX tensor (filled by the first traced run)
        self.missing_sites: list[str] = []
        #: ``"exact"`` or ``"standard_qdq"`` (:func:`onnx_form`)
        self.form = onnx_form(self.proto)
        #: the last traced run's model outputs against a plain session's; None before a traced run, at
        #: ``"disable_all"`` (nothing is fused) and when no graph output was added (outputs only)
        self.output_check: OutputCheck | None = None

    # -- description -------------------------------------------------------------------------------------
    def describe(self) -> str:
        where = f" from {self.source}" if self.source else ""
        props = {p.key: p.value for p in self.proto.metadata_props}
        model = props.get("quantlens.source_model", self.proto.graph.name or "model")
        form = ", standard QDQ form" if self.form == "standard_qdq" else ""
        return (f"{model} (ONNX{where}{form}, onnxruntime {self._ort.__version__}, "
                f"{ORT_LEVELS[self.optimization]})")

    def consistency(self) -> ConsistencyInfo:
        """An ONNX model does not record the consistency level (the analysis reports the qat IR's)."""
        return ConsistencyInfo(known=False, qpp="", source=f"{self.label} model (ONNX: not recorded)")

    @property
    def outputs_only(self) -> bool:
        """Whether only the model outputs are fetched (a standard-QDQ model above ``"disable_all"``, where
        per-op outputs would block the integer fusions): the trace then holds only the sites whose value is a
        model output. Not against a ``March.ORT_CPU`` quantized IR: its sites are read from the runtime's
        optimized graph (:mod:`.onnx_fused`)."""
        return self.optimization != "disable_all" and self.form == "standard_qdq" and not self._fused_pair()

    def _fused_pair(self) -> bool:
        ref = self.reference
        return getattr(ref, "kind", None) == "quantized" and ref.module.meta.get("march") == "ort_cpu"

    @property
    def site_note(self) -> str:
        """The note every traced row carries: no same-input output, plus why only model outputs are traced or
        that the outputs check failed."""
        level = ORT_LEVELS[self.optimization]
        extra = [OUTPUTS_ONLY_NOTE.format(level=level) if self.outputs_only else "",
                 self.output_check.note if self.output_check is not None else ""]
        return "; ".join([SAME_INPUT_NOTE, *filter(None, extra)])

    # -- running -----------------------------------------------------------------------------------------
    def _ir(self):
        from quantlens.profiler.ir_access import IRModelAccess

        ref = self.reference
        if isinstance(ref, IRModelAccess) and ref.kind == "quantized" and ref.module.meta.get("march") == "ort_cpu":
            return ref  # March.ORT_CPU: the quantized IR against the session, op by op (onnx_fused)
        if not isinstance(ref, IRModelAccess) or ref.kind != "qat":
            raise QuantLensError(
                "OnnxModelAccess needs the qat IR the ONNX model was written from (its op sites and value names): "
                "use QuantAnalysis(qat_ir, onnx_model, 'onnxruntime'), which sets it, or set access.reference = "
                "IRModelAccess(qat_ir, 'baseline').")
        return ref

    def _site_values(self, ref) -> dict[str, list[str]]:
        """Each traced site's ONNX tensor names: the IR names of its value (the outputs of its last IR node),
        or, for a value that is a model output, the ONNX output at the same position (outputs may be renamed)."""
        alias: dict[str, str] = {}
        for ir_name, onnx_name in zip(ref.module.graph.outputs, self.output_names):
            alias.setdefault(ir_name, onnx_name)
        sites, missing = {}, []
        for site in ref.sites:
            names = list(ref.nodes[ref.last[site]].outputs)
            if self.outputs_only:
                if all(n in alias for n in names):
                    sites[site] = [alias[n] for n in names]
                continue
            found = [n if n in self._produced else alias.get(n) for n in names]
            if None in found:
                missing.append(site)
                continue
            sites[site] = found
        self.missing_sites = missing
        return sites

    def _session(self, extra: tuple[str, ...]):
        if extra in self._sessions:
            return self._sessions[extra]
        onnx, ort = _imports()
        from quantlens.compiler.onnx.builder import onnx_dtype

        proto = self.proto
        if extra:
            proto = onnx.ModelProto()
            proto.CopyFrom(self.proto)
            ref = self._ir()
            for name in extra:
                info = ref.value_info(name)
                if info is None or info.dtype in ("", "unknown"):
                    raise QuantLensError(f"OnnxModelAccess: the qat IR has no dtype for value '{name}'; export the "
                                         "model again.")
                proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx_dtype(info.dtype), None))
        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVELS[self.optimization])
        options.log_severity_level = 3
        threads = num_threads()  # onnxruntime's own pool (one thread per core, spinning) collapses on a busy machine
        if threads > 0:
            options.intra_op_num_threads = threads
        try:
            session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            what = " ".join(str(exc).split())[:300]  # one line: onnxruntime's messages span several
            where = f" '{self.source}'" if self.source else ""
            raise QuantLensError(f"onnxruntime cannot load the ONNX model{where} ({type(exc).__name__}: {what}). "
                                 "If the file is damaged or was changed, write it again with to_onnx(qat_ir, "
                                 "path).") from exc
        self._sessions[extra] = session
        return session

    def run(self, example: Any, sink: TraceSink | None = None, same_input: SameInputSource | None = None,
            indices: dict[str, list[torch.Tensor]] | None = None, override: Any = None) -> Any:
        if indices is not None or override is not None:
            raise QuantLensError("OnnxModelAccess runs the whole graph in onnxruntime: it cannot take the "
                                 "baseline's indices or mix values with another model (no sensitivity).")
        from quantlens.profiler.ir_module import call_ir

        ref = self._ir()
        if ref.kind == "quantized":
            return self._run_fused(ref, example, sink)
        feeds = call_ir(ref.module, example)
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise QuantLensError(f"OnnxModelAccess: no value for the ONNX inputs {missing}; the qat IR's inputs are "
                                 f"{ref.module.input_names}.")
        sites = self._site_values(ref) if sink is not None else {}
        have = set(self.output_names)
        extra = tuple(dict.fromkeys(n for names in sites.values() for n in names if n not in have))
        arrays = {n: feeds[n].detach().cpu().contiguous().numpy() for n in self.input_names}
        fetch = self.output_names + list(extra)
        values = _tensors(fetch, self._session(extra).run(fetch, arrays))
        if sink is not None:
            # above disable_all a per-op graph output may block a float fusion: check the model outputs against a
            # plain session's (at disable_all nothing is fused; without extra outputs the session is the plain one)
            checked = bool(extra) and self.optimization != "disable_all"
            self.output_check = self._check_outputs(values, arrays) if checked else None
            note = self.site_note
            for index, (site, names) in enumerate(sites.items()):
                event = ref.site_event(site, index, [values[n] for n in names], feeds, {}, None)
                event.same_input_note = note
                sink.on_site(event)
        ir_outputs = ref.module.graph.outputs
        if len(ir_outputs) != len(self.output_names):
            raise QuantLensError(f"OnnxModelAccess: the ONNX model has {len(self.output_names)} outputs, the qat IR "
                                 f"{len(ir_outputs)}; pass the ONNX file written by to_onnx from this qat IR.")
        outs = [ref.to_float(name, values[onnx_name]) for name, onnx_name in zip(ir_outputs, self.output_names)]
        return pytree.tree_unflatten(outs, load_spec(ref.module.output_spec))

    def _run_fused(self, ref, example: Any, sink: TraceSink | None) -> Any:
        """A ``March.ORT_CPU`` quantized IR baseline: every op site's value from the runtime's optimized graph, each
        fused kernel also re-run alone on the IR's inputs to it (:mod:`.onnx_fused`)."""
        from quantlens.profiler.ir_module import call_ir
        from quantlens.profiler.onnx_fused import FLOAT_NOTE, FusedGraph

        if self.optimization != "all":
            raise QuantLensError("OnnxModelAccess: a March.ORT_CPU quantized IR is compared with onnxruntime at its "
                                 f"default level ('all'), the one the march is; got {self.optimization!r}.")
        if getattr(self, "_fused", None) is None:
            self._fused = FusedGraph(self.proto, ref, num_threads())
        fused = self._fused
        feeds = call_ir(ref.module, example)
        arrays = {n: feeds[n].detach().cpu().contiguous().numpy() for n in self.input_names}
        values = fused.run(arrays, self.output_names)
        last = {id(ref.nodes[where.ir_index]): site for site, where in fused.sites.items()}
        seen: dict[str, tuple[list, Any]] = {}

        def keep(node, inputs, outputs):
            if id(node) in last:
                seen[last[id(node)]] = (list(inputs), outputs[0] if isinstance(outputs, (list, tuple)) else outputs)

        ref.module.run(feeds, observer=keep)
        self.missing_sites = [site for site in ref.sites if site not in fused.sites]
        if sink is not None:
            tensors = {n: torch.from_numpy(np.array(values[n])) for n in self.output_names}
            self.output_check = self._check_outputs(tensors, arrays)
            constants = ref.module.graph.constants
            for index, site in enumerate(s for s in ref.sites if s in fused.sites and s in seen):
                where = fused.sites[site]
                node = ref.nodes[where.ir_index]
                inputs, ours = seen[site]
                theirs = fused.as_ir(where.output, values[where.output], values, ours)
                event = ref.site_event(site, index, [theirs], feeds, {}, None)
                if where.fused:
                    again = fused.same_input(where, node, inputs, values, constants)
                    again = fused.as_ir(where.output, again.numpy(), values, ours)
                    event.set_same_input([ref.to_float(node.outputs[0], again)], None, "")
                else:
                    event.same_input_note = FLOAT_NOTE
                sink.on_site(event)
        outs = [ref.to_float(name, torch.from_numpy(np.array(values[onnx_name])))
                for name, onnx_name in zip(ref.module.graph.outputs, self.output_names)]
        return pytree.tree_unflatten(outs, load_spec(ref.module.output_spec))

    def _check_outputs(self, traced: dict[str, torch.Tensor], arrays: dict) -> OutputCheck:
        """Run a plain session (model outputs only) and compare its outputs with the traced session's: an extra
        graph output can block a float fusion that changes the rounding."""
        plain = _tensors(self.output_names, self._session(()).run(self.output_names, arrays))
        diff, equal = 0.0, True
        for name in self.output_names:
            a, b = traced[name], plain[name]
            if _bit_equal(a, b):
                continue
            equal = False
            diff = max(diff, float((a.double() - b.double()).abs().nan_to_num(nan=math.inf).max())
                       if a.shape == b.shape else math.inf)
        return OutputCheck(ORT_LEVELS[self.optimization], equal, diff)

    # -- sensitivity: not offered ------------------------------------------------------------------------
    def quantizers(self, analysis_type: AnalysisType) -> list[Quantizer]:
        raise QuantLensError(
            "sensitivity() is not offered for 'onnxruntime': onnxruntime runs the whole graph and its quantizers "
            "cannot be switched off one by one. Rank the quantizers on the torch stages ('fake_quant', "
            "'pre_export') or the IR ('export', 'convert').")

    @contextmanager
    def ablation(self, analysis_type: AnalysisType):
        self.quantizers(analysis_type)
        yield  # pragma: no cover
