"""The tools of ``bench_peers.py``: each ``setup_<tool>(net)`` quantizes ``net`` with the tool's own flow (setup,
not measured) and returns ``compare()``, the measured per-layer float-vs-quantized comparison. ``compare()``
returns ``({layer name: error number}, rows)`` for the float net's layers it covers (rows it gives for anything
else are counted under ``rows``). The flows are described in ``bench_peers.py``'s docstring."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import re
import tempfile
import warnings
from pathlib import Path

import torch
from bench_peers_nets import Net, fx_traceable


def _finite_or_inf(v) -> bool:
    try:
        return not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def calibrated(net: Net) -> torch.nn.Module:
    """quantlens' calibration model of ``net`` (``prepare``, calibrated on ``net.calib``, in validation state)."""
    from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    example = tuple(a[:8] for a in net.calib[0])
    # resnet18 and minilm are transformers' code without QuantStub; the zoo nets have stubs
    calib = prepare(net.model, example, default_calibration_qconfig_setter, check_result_dir=None,
                    allow_no_stubs=net.name in ("resnet18", "minilm"))
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for b in net.calib:
            calib(*b)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    return calib


def setup_quantlens(net: Net):
    from quantlens.profiler import QuantAnalysis

    calib = calibrated(net)

    def compare():
        with tempfile.TemporaryDirectory() as out_dir:
            qa = QuantAnalysis(net.model, calib, "fake_quant", out_dir=out_dir, progress=False)
            qa.set_bad_case(net.args)
            qa.run()
            table = qa.compare_per_layer()
        numbers = {row.op_name: row.SQNR for row in table if row.SQNR is not None}
        return numbers, len(table)

    return compare


def setup_torchao(net: Net):
    from torchao.quantization.pt2e import (
        compare_results,
        extract_results_from_loggers,
        generate_numeric_debug_handle,
        prepare_for_propagation_comparison,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    ep = torch.export.export(net.model, net.args)
    generate_numeric_debug_handle(ep)
    float_gm = ep.module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for b in net.calib:
            prepared(*b)
    converted = convert_pt2e(prepared)

    def compare():
        ref = prepare_for_propagation_comparison(float_gm)
        act = prepare_for_propagation_comparison(converted)
        with torch.no_grad():
            ref(*net.args)
            act(*net.args)
        ref_results, act_results = extract_results_from_loggers(ref), extract_results_from_loggers(act)
        # Workaround: compare_results raises ValueError on a logged None, the output of the
        # _assert_tensor_metadata checks that Tensor.to leaves in an exported graph (transformers' attention-mask
        # code has them); those entries are left out of both sides.
        dropped = [k for k, (_, _, stats) in ref_results.items() if any(v is None for v in stats)]
        for k in dropped:
            ref_results.pop(k)
            act_results.pop(k, None)
        if dropped:
            compare.note = (f"{len(dropped)} logged None outputs (_assert_tensor_metadata) left out: "
                            "compare_results raises ValueError on them")
        comparison = compare_results(ref_results, act_results)
        numbers = {}
        for summary in comparison.values():
            sqnr = [float(r.sqnr) for r in summary.results]
            key = net.node_key.get(summary.ref_node_name)
            if key is not None:
                numbers[key] = sqnr[0]
        return numbers, len(comparison)

    return compare


def _fx_layer_keys(net: Net, float_fx: torch.nn.Module) -> dict[str, str]:
    """symbolic_trace node name -> layer name: modules by path, functions by kind and execution order."""
    gm = torch.fx.symbolic_trace(float_fx)
    by_kind: dict[str, list[str]] = {}
    for key in net.layers:
        m = re.match(r"(?:.*\.)?([a-z_0-9]+?)_\d+$", key)
        if m and key not in dict(net.model.named_modules()):
            by_kind.setdefault(m.group(1), []).append(key)
    keys, seen = {}, {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            keys[node.name] = str(node.target)
        elif node.op in ("call_function", "call_method"):
            kind = re.sub(r"_\d+$", "", node.name)
            i = seen.get(kind, 0)
            seen[kind] = i + 1
            if i < len(by_kind.get(kind, [])):
                keys[node.name] = by_kind[kind][i]
    return keys


def setup_nsfx(net: Net):
    import torch.ao.ns._numeric_suite_fx as ns
    from torch.ao.ns.fx.utils import compute_sqnr
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = "x86"
    float_fx, changes = fx_traceable(net.model)  # the same net; transformers' ResNet needs two changes
    prepared = prepare_fx(copy.deepcopy(float_fx), get_default_qconfig_mapping("x86"), net.args)
    with torch.no_grad():
        for b in net.calib:
            prepared(*b)
    quantized = convert_fx(prepared)
    keys = _fx_layer_keys(net, float_fx)

    def compare():
        mp_a, mp_b = ns.add_loggers("fp32", float_fx, "int8", quantized, ns.OutputLogger)
        with torch.no_grad():
            mp_a(*net.args)
            mp_b(*net.args)
        results = ns.extract_logger_info(mp_a, mp_b, ns.OutputLogger, "int8")
        ns.extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
        numbers = {}
        for layer in results.values():
            for entry in layer["node_output"]["int8"]:
                key = keys.get(entry["ref_node_name"])
                if key is not None:
                    numbers[key] = float(entry["sqnr"][0])
        return numbers, len(results)

    if changes:
        compare.note = "FX-traceable copy: " + "; ".join(changes)
    return compare


_TEMP_DIRS: list[tempfile.TemporaryDirectory] = []


def _torch_outputs(net: Net) -> dict[str, torch.Tensor]:
    """{layer name: output} of one float forward of the measured input through the exported float graph (a layer
    of several nodes keeps its last node's output)."""
    outputs = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            key = net.node_key.get(n.name)
            if key is not None and isinstance(result, torch.Tensor):
                outputs[key] = result.detach()
            return result

    with torch.no_grad():
        Recorder(torch.export.export(net.model, net.args).module()).run(*net.args)
    return outputs


def _match_by_value(net: Net, onnx_values: dict) -> dict[str, list[str]]:
    """ONNX tensor name -> the layers whose float output it equals: same values in the same order (the augmented
    model's outputs are flattened), relative L2 difference < 1e-4."""
    by_size: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for key, t in _torch_outputs(net).items():
        if t.dtype.is_floating_point:
            by_size.setdefault(t.numel(), []).append((key, t.double().flatten()))
    keys = {}
    for name, value in onnx_values.items():
        v = torch.from_numpy(value)
        if not v.dtype.is_floating_point:
            continue
        v = v.double().flatten()
        found = [key for key, t in by_size.get(v.numel(), ())
                 if float((v - t).norm()) <= 1e-4 * max(float(t.norm()), 1e-12)]
        if found:
            keys[name] = found
    return keys


def setup_ort(net: Net):
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization import qdq_loss_debug as qdq

    class Reader(CalibrationDataReader):
        def __init__(self, batches):
            self._it = iter([{n: a.numpy() for n, a in zip(net.input_names, b)} for b in batches])

        def get_next(self):
            return next(self._it, None)

    def session_options():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        return so

    tmp = tempfile.TemporaryDirectory(prefix=f"bench_peers_{net.name}_")
    _TEMP_DIRS.append(tmp)
    work = Path(tmp.name)
    float_path, qdq_path = work / "float.onnx", work / "qdq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.model, net.args, str(float_path), dynamo=False, opset_version=17,
                          input_names=list(net.input_names))
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # quantize_static logs "consider pre-processing" warnings
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(float_path), str(qdq_path), Reader(net.calib), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True)
    root.setLevel(level)

    # ONNX tensor name -> layer names, by value: the float ONNX model's intermediate tensors against the exported
    # float torch graph's op outputs on the measured input (same values, relative difference < 1e-4; a conv with
    # its batch norm folded in matches the batch norm's output). Setup, not measured.
    aug_float, aug_qdq = work / "float_aug.onnx", work / "qdq_aug.onnx"
    qdq.modify_model_output_intermediate_tensors(str(float_path), str(aug_float))
    onnx_values = qdq.collect_activations(str(aug_float), Reader([net.args]), session_options=session_options(),
                                          execution_providers=["CPUExecutionProvider"])
    keys = _match_by_value(net, {name: v[0] for name, v in onnx_values.items()})
    del onnx_values

    def compare():
        qdq.modify_model_output_intermediate_tensors(str(float_path), str(aug_float))
        qdq.modify_model_output_intermediate_tensors(str(qdq_path), str(aug_qdq))
        float_act = qdq.collect_activations(str(aug_float), Reader([net.args]), session_options=session_options(),
                                            execution_providers=["CPUExecutionProvider"])
        qdq_act = qdq.collect_activations(str(aug_qdq), Reader([net.args]), session_options=session_options(),
                                          execution_providers=["CPUExecutionProvider"])
        matching = qdq.create_activation_matching(qdq_act, float_act)
        errors = qdq.compute_activation_error(matching)
        numbers = {}
        for name, err in errors.items():
            for key in keys.get(name, ()):
                if "xmodel_err" in err:
                    numbers[key] = float(err["xmodel_err"])
        return numbers, len(errors)

    return compare


SETUP = {"quantlens": setup_quantlens, "torchao": setup_torchao, "nsfx": setup_nsfx, "ort": setup_ort}


