"""quantlens' per-layer float-vs-quantized comparison against its open peers, on the same nets and inputs.

Tools (each quantizes with its own flow; that quantization is setup and is not measured):

* ``quantlens``: float vs calibrated fake-quant model (``prepare`` + calibration), ``QuantAnalysis(...,
  "fake_quant")`` + ``set_bad_case`` + ``run()`` + ``compare_per_layer()`` (writes its report files into a
  temporary folder, as it always does).
* ``torchao pt2e``: ``torch.export`` + ``generate_numeric_debug_handle`` + ``prepare_pt2e``/``convert_pt2e`` with
  ``X86InductorQuantizer`` (setup); measured: ``prepare_for_propagation_comparison`` on the float and the
  converted model, one forward each, ``extract_results_from_loggers`` x2, ``compare_results`` and reading every
  node's SQNR.
* ``torch NS FX``: ``prepare_fx``/``convert_fx`` with the default ``x86`` qconfig mapping (setup); measured:
  ``add_loggers`` (float vs quantized, ``OutputLogger``), one forward each, ``extract_logger_info``,
  ``extend_logger_results_with_comparison(compute_sqnr)``.
* ``ORT qdq_loss_debug``: legacy ``torch.onnx.export`` of the float net + ``quantize_static`` (QDQ, int8,
  per-channel weights) (setup); measured: ``modify_model_output_intermediate_tensors`` on both files, one
  ``collect_activations`` each (new sessions, ``intra_op_num_threads=1``), ``create_activation_matching`` and
  ``compute_activation_error``.

Nets: the trained ``digits_cnn`` on 64 test images (calibrated on 512 training images), and ``tiny_resnet`` on
a 64-image batch of ``sample_batches`` (calibrated on 8 other batches of 64).

For each tool and net: time of the comparison / time of two plain float forwards (torch eager, same net, same
input, best of 20); warm-up once, best of 3. Peak memory: the resident set size sampled every millisecond
during one more comparison, minus the size just before it (after ``gc.collect()`` and glibc ``malloc_trim``,
so memory freed by earlier runs does not hide the new peak). tracemalloc is not used: torch's CPU allocator is
invisible to it. Layers: the float net's ops (from ``torch.export``, QuantStub/DeQuantStub excluded; names as
quantlens gives them: ``layer1.conv1``, ``layer1.add_0``, ``cat_0``) for which the tool reports an error number.

One thread: ``torch.set_num_threads(1)`` and ORT sessions with ``intra_op_num_threads=1``.

Setup (installs the peers into the current venv, ``--no-deps`` so the pinned torch stays)::

    python benchmarks/bench_peers.py --setup
    # same as: python -m pip install --no-deps -r benchmarks/requirements-peers.txt

Run::

    python benchmarks/bench_peers.py [--nets digits_cnn,tiny_resnet] [--tools quantlens,torchao,nsfx,ort]
                                     [--repeats 3] [--json FILE]

A peer that is not installed is reported as such (its row says why) instead of failing the run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import io
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_profiler import PeakRSS  # noqa: E402  (the same resident-set sampler as the profiler benchmark)

REQUIREMENTS = HERE / "requirements-peers.txt"
BATCH = 64
TOOLS = ("quantlens", "torchao", "nsfx", "ort")
TOOL_LABEL = {
    "quantlens": "quantlens",
    "torchao": "torchao pt2e debugger",
    "nsfx": "torch NS FX",
    "ort": "ORT qdq_loss_debug",
}


# ---------------------------------------------------------------------------------------------------- memory


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


def _release_memory() -> None:
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)




def measure(fn, repeats: int):
    """Warm up once, best time of ``repeats`` runs, then one more run for the peak RSS delta."""
    result = fn()
    times = []
    for _ in range(repeats):
        _release_memory()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    del result
    _release_memory()
    with PeakRSS() as peak:
        result = fn()
    return min(times), peak.extra, result


# ---------------------------------------------------------------------------------------------------- nets


@dataclass
class Net:
    name: str
    model: torch.nn.Module
    x: torch.Tensor  # the measured input, [64, ...]
    calib: list[torch.Tensor]  # calibration batches of 64
    layers: list[str]  # the float net's ops, quantlens' names
    node_key: dict[str, str] = field(default_factory=dict)  # exported float graph node name -> layer name
    group: dict[str, int] = field(default_factory=dict)  # layer name -> fusion group


_STUBS = ("QuantStub", "DeQuantStub")


def _layers_of(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """The float net's ops from ``torch.export`` (stubs are identities and vanish), named like quantlens' op
    sites: the leaf module's path, or ``<owner>.<op>_<k>`` for a function called in a module's forward.

    Also the fusion groups: a batch_norm, relu or add whose first tensor input comes from a conv, linear,
    batch_norm or add with no other user joins that producer's group (conv-bn-relu, conv-bn-add-relu). Every
    quantization flow fuses these, so only the group's last output exists in a quantized model."""
    ep = torch.export.export(model, (x,))
    modules = dict(model.named_modules())
    layers, node_key, counts, group, kind_of = [], {}, {}, {}, {}
    for node in ep.module().graph.nodes:
        if node.op != "call_function" or "getitem" in str(node.target):
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        path = stack[-1][0] if stack else ""
        mod = modules.get(path)
        kind = str(node.target).split(".")[1] if str(node.target).startswith("aten.") else node.name
        if mod is not None and path and not list(mod.children()):
            key = path
        else:
            k = counts.get((path, kind), 0)
            counts[(path, kind)] = k + 1
            key = f"{path}.{kind}_{k}" if path else f"{kind}_{k}"
        if key not in layers:
            layers.append(key)
        node_key[node.name] = key
        kind_of[node.name] = kind
        group[node.name] = node.name  # its own group unless it joins its producer's
        if kind in ("batch_norm", "relu", "add"):
            src = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
            if (src is not None and src.name in group and len(src.users) == 1
                    and kind_of[src.name] in ("conv2d", "linear", "batch_norm", "add")):
                group[node.name] = group[src.name]
    ids = {g: i for i, g in enumerate(dict.fromkeys(group.values()))}
    return layers, node_key, {node_key[n]: ids[g] for n, g in group.items()}


def build_net(name: str) -> Net:
    from quantlens.zoo import get_model, load_digits_data, sample_batches

    model = get_model(name).eval()
    if name == "digits_cnn":
        data = load_digits_data()
        x = data.x_test[:BATCH].contiguous()
        calib = [data.x_train[i : i + BATCH].contiguous() for i in range(0, 512, BATCH)]
    else:
        batches = sample_batches(name, 9, BATCH)
        calib = [b[0] for b in batches[:8]]
        x = batches[8][0]
    layers, node_key, group = _layers_of(model, x)
    return Net(name, model, x, calib, layers, node_key, group)


# ---------------------------------------------------------------------------------------------------- tools
# Each setup_<tool>(net) quantizes with the tool's own flow (not measured) and returns compare(), the measured
# per-layer comparison; compare() returns {layer name: error number} for the float net's layers it covers
# (rows it gives for anything else are counted under "rows").


def _finite_or_inf(v) -> bool:
    try:
        return not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def setup_quantlens(net: Net):
    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    calib = prepare(net.model, net.calib[0][:8], default_calibration_qconfig_setter, check_result_dir=None)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for b in net.calib:
            calib(b)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)

    def compare():
        with tempfile.TemporaryDirectory() as out_dir:
            qa = QuantAnalysis(net.model, calib, "fake_quant", out_dir=out_dir, progress=False)
            qa.set_bad_case((net.x,))
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

    ep = torch.export.export(net.model, (net.x,))
    generate_numeric_debug_handle(ep)
    float_gm = ep.module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(ep.module(), quantizer)
    with torch.no_grad():
        for b in net.calib:
            prepared(b)
    converted = convert_pt2e(prepared)

    def compare():
        ref = prepare_for_propagation_comparison(float_gm)
        act = prepare_for_propagation_comparison(converted)
        with torch.no_grad():
            ref(net.x)
            act(net.x)
        comparison = compare_results(extract_results_from_loggers(ref), extract_results_from_loggers(act))
        numbers = {}
        for summary in comparison.values():
            sqnr = [float(r.sqnr) for r in summary.results]
            key = net.node_key.get(summary.ref_node_name)
            if key is not None:
                numbers[key] = sqnr[0]
        return numbers, len(comparison)

    return compare


def _fx_layer_keys(net: Net) -> dict[str, str]:
    """symbolic_trace node name -> layer name: modules by path, functions by kind and execution order."""
    gm = torch.fx.symbolic_trace(net.model)
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
    prepared = prepare_fx(copy.deepcopy(net.model), get_default_qconfig_mapping("x86"), (net.x,))
    with torch.no_grad():
        for b in net.calib:
            prepared(b)
    quantized = convert_fx(prepared)
    keys = _fx_layer_keys(net)

    def compare():
        mp_a, mp_b = ns.add_loggers("fp32", net.model, "int8", quantized, ns.OutputLogger)
        with torch.no_grad():
            mp_a(net.x)
            mp_b(net.x)
        results = ns.extract_logger_info(mp_a, mp_b, ns.OutputLogger, "int8")
        ns.extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
        numbers = {}
        for layer in results.values():
            for entry in layer["node_output"]["int8"]:
                key = keys.get(entry["ref_node_name"])
                if key is not None:
                    numbers[key] = float(entry["sqnr"][0])
        return numbers, len(results)

    return compare


_TEMP_DIRS: list[tempfile.TemporaryDirectory] = []
_ONNX_KIND = {"Add": "add", "Concat": "cat", "Flatten": "flatten", "Reshape": "flatten"}


def setup_ort(net: Net):
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization import qdq_loss_debug as qdq

    class Reader(CalibrationDataReader):
        def __init__(self, batches):
            self._it = iter([{"x": b.numpy()} for b in batches])

        def get_next(self):
            return next(self._it, None)

    tmp = tempfile.TemporaryDirectory(prefix=f"bench_peers_{net.name}_")
    _TEMP_DIRS.append(tmp)
    work = Path(tmp.name)
    float_path, qdq_path = work / "float.onnx", work / "qdq.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.model, (net.x,), str(float_path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # quantize_static logs "consider pre-processing" warnings
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_static(str(float_path), str(qdq_path), Reader(net.calib), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True)
    root.setLevel(level)

    # ONNX tensor name -> layer name: the producing node "/layer1/conv1/Conv" is module layer1.conv1;
    # "/layer1/Add" is layer1's first add (quantlens' layer1.add_0).
    modules = dict(net.model.named_modules())
    keys, counts = {}, {}
    for node in onnx.load(str(float_path)).graph.node:
        path = ""
        for part in node.name.strip("/").split("/")[:-1]:  # "/layer2/downsample/downsample.0/Conv"
            last = path.rsplit(".", 1)[-1] if path else ""
            if last and part.startswith(last + "."):
                path = path[: len(path) - len(last)] + part
            else:
                path = f"{path}.{part}" if path else part
        if path in modules and path and not list(modules[path].children()):
            key = path
        else:
            kind = _ONNX_KIND.get(node.op_type, node.op_type.lower())
            k = counts.get((path, kind), 0)
            counts[(path, kind)] = k + 1
            key = f"{path}.{kind}_{k}" if path else f"{kind}_{k}"
        for out in node.output:
            keys[out] = key

    def session_options():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        return so

    def compare():
        aug_float, aug_qdq = work / "float_aug.onnx", work / "qdq_aug.onnx"
        qdq.modify_model_output_intermediate_tensors(str(float_path), str(aug_float))
        qdq.modify_model_output_intermediate_tensors(str(qdq_path), str(aug_qdq))
        float_act = qdq.collect_activations(str(aug_float), Reader([net.x]), session_options=session_options(),
                                            execution_providers=["CPUExecutionProvider"])
        qdq_act = qdq.collect_activations(str(aug_qdq), Reader([net.x]), session_options=session_options(),
                                          execution_providers=["CPUExecutionProvider"])
        matching = qdq.create_activation_matching(qdq_act, float_act)
        errors = qdq.compute_activation_error(matching)
        numbers = {}
        for name, err in errors.items():
            key = keys.get(name)
            if key is not None and "xmodel_err" in err:
                numbers[key] = float(err["xmodel_err"])
        return numbers, len(errors)

    return compare


SETUP = {"quantlens": setup_quantlens, "torchao": setup_torchao, "nsfx": setup_nsfx, "ort": setup_ort}


# ---------------------------------------------------------------------------------------------------- main


@dataclass
class Row:
    tool: str
    net: str
    ratio: float | None = None
    seconds: float | None = None
    two_forwards_s: float | None = None
    peak_rss_mib: float | None = None
    layers_with_number: int | None = None
    layers_total: int | None = None
    groups_with_number: int | None = None
    groups_total: int | None = None
    rows: int | None = None
    missing: list[str] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)  # layer name -> SQNR (dB)
    error: str | None = None


def two_forwards(net: Net) -> tuple[float, int]:
    def fw():
        with torch.no_grad():
            net.model(net.x)
            net.model(net.x)

    best, peak, _ = measure(fw, 20)
    return best, peak


def run_bench(nets: list[str], tools: list[str], repeats: int) -> tuple[list[Row], dict]:
    rows, baselines = [], {}
    for net_name in nets:
        net = build_net(net_name)
        base_s, base_peak = two_forwards(net)
        baselines[net_name] = {"two_forwards_s": base_s, "peak_rss_mib": base_peak / 2**20,
                               "layers": net.layers}
        for tool in tools:
            groups = {}
            for k in net.layers:
                groups.setdefault(net.group[k], []).append(k)
            row = Row(TOOL_LABEL[tool], net_name, two_forwards_s=base_s, layers_total=len(net.layers),
                      groups_total=len(groups))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compare = SETUP[tool](net)
                    best, peak, (numbers, n_rows) = measure(compare, repeats)
            except ImportError as e:
                row.error = f"not installed ({e.name}); run with --setup"
            except Exception as e:  # a peer that fails on a net is a result, not a crash
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            else:
                row.seconds, row.ratio, row.peak_rss_mib = best, best / base_s, peak / 2**20
                covered = [k for k in net.layers if k in numbers and _finite_or_inf(numbers[k])]
                row.layers_with_number, row.rows = len(covered), n_rows
                row.missing = [k for k in net.layers if k not in covered]
                row.groups_with_number = sum(any(k in covered for k in g) for g in groups.values())
                row.numbers = {k: float(numbers[k]) for k in covered}
            finally:
                while _TEMP_DIRS:
                    _TEMP_DIRS.pop().cleanup()
            rows.append(row)
            print(f"  {net_name:12s} {tool:10s} done", file=sys.stderr, flush=True)
    return rows, baselines


def print_table(rows: list[Row], baselines: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Per-layer float-vs-quantized comparison, batch {BATCH}, "
                        f"{torch.get_num_threads()} thread(s)")
    for col in ("tool", "net", "time / two forwards", "time", "peak RSS delta", "fused groups with a number",
                "ops with a number"):
        table.add_column(col, justify="left" if col in ("tool", "net") else "right")
    for net, b in baselines.items():
        table.add_row("two float forwards", net, "1.0x", f"{b['two_forwards_s'] * 1e3:.2f} ms",
                      f"{b['peak_rss_mib']:.1f} MiB", "", "")
    for r in rows:
        if r.error:
            table.add_row(r.tool, r.net, "-", "-", "-", f"[red]{r.error}[/red]", "")
            continue
        every = "all" if r.groups_with_number == r.groups_total else "not all"
        table.add_row(r.tool, r.net, f"{r.ratio:.1f}x", f"{r.seconds * 1e3:.0f} ms", f"{r.peak_rss_mib:.1f} MiB",
                      f"{r.groups_with_number}/{r.groups_total} ({every})",
                      f"{r.layers_with_number}/{r.layers_total} ({r.rows} rows)")
    Console(width=max(Console().width, 130)).print(table)
    for r in rows:
        if r.missing:
            print(f"{r.tool} / {r.net}: no number for {', '.join(r.missing)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true",
                        help=f"pip install --no-deps -r {REQUIREMENTS.relative_to(HERE.parent)} and exit")
    parser.add_argument("--nets", default="digits_cnn,tiny_resnet")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"subset of {','.join(TOOLS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.setup:
        return subprocess.call([sys.executable, "-m", "pip", "install", "--no-deps", "-r", str(REQUIREMENTS)])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        parser.error(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    rows, baselines = run_bench([n.strip() for n in args.nets.split(",")], tools, args.repeats)
    print_table(rows, baselines)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "batch": BATCH,
                                               "baselines": baselines, "rows": [asdict(r) for r in rows]},
                                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
