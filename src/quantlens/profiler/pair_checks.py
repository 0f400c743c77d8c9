"""Whether two models make a valid pair for an analysis type, checked before anything runs: the deployed stages'
pairs (which IR, which baseline; the baseline becomes the IR's reference for sensitivity; a quantized IR or ONNX
model made from another qat IR than the baseline is refused, :mod:`quantlens.compiler.provenance`) and, for the
torch stages, that the analysis model is the baseline's network (its weights are the baseline's, up to QAT)."""

from __future__ import annotations

import torch

from quantlens.errors import QuantLensError
from quantlens.profiler.model_access import AnalysisType, ModelAccess

__all__ = ["check_deployed_pair", "check_weights_correspond", "UNRELATED_WEIGHT_RATIO"]

#: a weight tensor whose relative difference ``||w_b - w_a|| / max(||w_b||, ||w_a||)`` exceeds this is not the
#: same weight (QAT fine-tuning moves weights by a few percent; two independent initialisations give about 1.4)
UNRELATED_WEIGHT_RATIO = 0.5


def _torch_weights(access) -> dict[str, torch.Tensor] | None:
    """The conv/linear/embedding-like weights (parameters with 2 or more dims) of a torch model, by the
    qualified name they have in the *float* model: a BatchNorm folded by prepare into ``<conv>.bn`` is listed
    under its float name. None for a model that is not a torch module."""
    from quantlens.profiler.torch_access import TorchModelAccess

    if not isinstance(access, TorchModelAccess):
        return None
    renames: list[tuple[str, str]] = []
    if access.prepared:
        sites = access.state.record.sites
        for group in access.state.groups:
            if group.bn is not None and group.bn in sites and group.head in sites:
                renames.append((sites[group.head].module_name + ".bn.", sites[group.bn].module_name + "."))
    weights = {}
    for name, param in access.model.named_parameters():
        if param.dim() < 2 or not param.is_floating_point():
            continue
        for prefix, float_prefix in renames:
            if name.startswith(prefix):
                name = float_prefix + name[len(prefix):]
                break
        weights[name] = param.detach()
    return weights


def check_weights_correspond(baseline, analysis, kind: AnalysisType) -> None:
    """Refuse two torch models that are not the same network: every weight of the analysis model (a prepared
    model keeps its float model's weights unfolded in its QAT modules) must be the baseline's weight of the
    same name, up to what QAT training moves. Weights only on one side, or of another shape, are not
    compared (the op site match of :meth:`QuantAnalysis.run` covers structure)."""
    base, analy = _torch_weights(baseline), _torch_weights(analysis)
    if not base or not analy:
        return
    compared, unrelated = 0, []
    for name, wb in base.items():
        wa = analy.get(name)
        if wa is None or wa.shape != wb.shape:
            continue
        compared += 1
        if wa.device == wb.device and wa.dtype == wb.dtype and torch.equal(wa, wb):
            continue  # the same values (an untrained prepared model's copy): one compare, no float64 copies
        # NaN/Inf in the same place on both sides is the same weight (a NaN report is sensitivity's business)
        wb64, wa64 = (torch.nan_to_num(w.to(torch.float64).cpu(), nan=0.0, posinf=0.0, neginf=0.0) for w in (wb, wa))
        norm = max(float(wb64.norm()), float(wa64.norm()))
        diff = float((wb64 - wa64).norm())
        ratio = diff / norm if norm > 0 else 0.0
        if ratio > UNRELATED_WEIGHT_RATIO:
            unrelated.append((name, ratio))
    if not unrelated:
        return
    shown = ", ".join(f"'{n}' (relative difference {r:.2f})" for n, r in unrelated[:3])
    more = f" and {len(unrelated) - 3} more" if len(unrelated) > 3 else ""
    pair = ("The analysis model must be prepare(baseline_model, ...) (calibrated or QAT-trained from it)"
            if kind is AnalysisType.FAKE_QUANT else "The analysis model must be pre_export(baseline_model)")
    raise QuantLensError(
        f"QuantAnalysis('{kind.value}'): the two models do not correspond: {len(unrelated)} of {compared} weights "
        f"differ entirely between baseline_model and analysis_model: {shown}{more}. They are the same op sites "
        f"with other weights, so every op site would show an error that is not quantization. {pair}: a prepared "
        "model keeps the float weights (QAT training moves them by a few percent, not more than "
        f"{UNRELATED_WEIGHT_RATIO:.0%}). Fix: prepare the analysis model from this baseline model, or load the "
        "same state dict into the float model the analysis model was prepared from."
    )


def _set_integer_rules(kind: AnalysisType, *accesses: ModelAccess) -> None:
    """Each torch model of the pair runs what the other model is meant to equal: for ``export``, float + fake quant
    (export traces the forward without the consistency level's integer rules, so the qat IR computes that at every
    level); for every other pair, the model's own forward (at levels 1-4 with the integer rules, which the
    quantized IR equals bit for bit)."""
    for access in accesses:
        if hasattr(access, "integer_rules"):
            access.integer_rules = kind is not AnalysisType.EXPORT


def check_deployed_pair(kind: AnalysisType, baseline: ModelAccess, analysis: ModelAccess) -> None:
    """export: the analysis model is the qat IR; convert: the quantized IR. Their baseline is the stage
    before (or an earlier torch stage of the same model); IR analyses get their baseline as the reference
    of sensitivity (one op site computed by the IR, the rest by the baseline). onnxruntime: the analysis
    model is the ONNX model of the qat IR baseline, which gives it its op sites and their value names."""
    from quantlens.profiler.ir_access import IRModelAccess
    from quantlens.profiler.onnx_access import OnnxModelAccess

    is_ir = isinstance(analysis, IRModelAccess)
    _set_integer_rules(kind, baseline, analysis)
    if (kind is AnalysisType.ONNXRUNTIME) != isinstance(analysis, OnnxModelAccess):
        raise QuantLensError(
            f"QuantAnalysis('{kind.value}'): " + ("analysis_model must be the ONNX model written by "
            f"to_onnx(qat_ir, path) (its path or onnx.ModelProto, or an OnnxModelAccess), got "
            f"{type(getattr(analysis, 'model', getattr(analysis, 'module', None))).__name__}."
            if kind is AnalysisType.ONNXRUNTIME else
            "the analysis model is an ONNX model; ONNX models are analysed with 'onnxruntime' (qat IR vs its "
            "ONNX model)."))
    if kind is AnalysisType.ONNXRUNTIME:  # the qat IR supplies the op sites and their ONNX value names
        if isinstance(baseline, IRModelAccess) and baseline.kind == "quantized" and \
                baseline.module.meta.get("march") == "ort_cpu":  # the march's IR against the session, op by op
            _check_provenance(kind, baseline, analysis)
            analysis.reference = baseline
            return
        if not (isinstance(baseline, IRModelAccess) and baseline.kind == "qat"):
            got = f"a {baseline.kind} IR" if isinstance(baseline, IRModelAccess) else \
                type(getattr(baseline, "model", None)).__name__
            raise QuantLensError(
                f"QuantAnalysis('onnxruntime'): baseline_model must be the qat IR the ONNX model was written "
                f"from (export(pre_export_model, example), then to_onnx), or under March.ORT_CPU its quantized IR "
                f"(convert(qat_ir)), got {got}.")
        _check_provenance(kind, baseline, analysis)
        analysis.reference = baseline
        return
    if not kind.deployed:
        if is_ir:
            raise QuantLensError(
                f"QuantAnalysis('{kind.value}'): the analysis model is a {analysis.kind} IR; IR models are "
                "analysed with 'export' (pre_export model vs qat IR) or 'convert' (qat IR vs quantized IR).")
        return
    want = "qat" if kind is AnalysisType.EXPORT else "quantized"
    if not is_ir or analysis.kind != want:
        got = f"a {analysis.kind} IR" if is_ir else type(getattr(analysis, "model", None)).__name__
        raise QuantLensError(
            f"QuantAnalysis('{kind.value}'): analysis_model must be the {want} IR "
            f"({'export(pre_export_model, example)' if want == 'qat' else 'convert(qat_ir)'}), got {got}. "
            "Pairs: 'export' (pre_export model, qat IR), 'convert' (qat IR or pre_export model, quantized IR).")
    if isinstance(baseline, IRModelAccess) and (kind is AnalysisType.EXPORT or baseline.kind != "qat"):
        raise QuantLensError(
            f"QuantAnalysis('{kind.value}'): baseline_model is a {baseline.kind} IR; expected "
            f"{'the pre_export model' if kind is AnalysisType.EXPORT else 'the qat IR or the pre_export model'}.")
    if not baseline.quantized:
        raise QuantLensError(
            f"QuantAnalysis('{kind.value}'): baseline_model is a float model; compare neighbouring stages "
            "(the pre_export model or the qat IR).")
    if isinstance(baseline, IRModelAccess):  # a qat IR and its quantized IR
        _check_provenance(kind, baseline, analysis)
    analysis.reference = baseline


def _check_provenance(kind: AnalysisType, baseline, analysis) -> None:
    """The derived model (the quantized IR, the ONNX model) was made from the qat IR baseline: its recorded digest
    of the qat IR must be the baseline's (else another version of the model would be compared, and every op site
    would show a difference that is not the deployment's). A model that records none gets a warning."""
    import warnings

    from quantlens.compiler.provenance import ONNX_SOURCE_DIGEST_PROP, SOURCE_DIGEST_KEY, check_source
    from quantlens.errors import QuantLensWarning

    where = f" '{analysis.source}'" if analysis.source else ""
    if kind is AnalysisType.ONNXRUNTIME:
        props = {p.key: p.value for p in analysis.proto.metadata_props}
        recorded = props.get(ONNX_SOURCE_DIGEST_PROP)
        derived = f"the ONNX file{where}" if where else "the ONNX model"
        remake = "to_onnx(qat_ir, path)"
        if baseline.kind == "quantized":  # both were made from one qat IR: their recorded digests agree
            made_from = baseline.module.meta.get(SOURCE_DIGEST_KEY)
            if recorded is not None and made_from is not None and recorded != made_from:
                raise QuantLensError(
                    f"QuantAnalysis('onnxruntime'): {derived} was made from the qat IR with digest {recorded[:12]}..., "
                    f"and the quantized IR given with it from {made_from[:12]}...: they belong to different versions "
                    "of the model. Write both from one qat IR: convert(qat_ir) and to_onnx(qat_ir, path).")
            return
    else:
        recorded = analysis.module.meta.get(SOURCE_DIGEST_KEY)
        derived = f"the quantized IR{where}"
        remake = "convert(qat_ir) (and save)"
    warning = check_source(recorded, baseline.module, who=f"QuantAnalysis('{kind.value}')", derived=derived,
                           remake=remake, source_name=baseline.source)
    if warning:
        warnings.warn(warning, QuantLensWarning, stacklevel=4)

