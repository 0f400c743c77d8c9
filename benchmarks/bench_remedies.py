"""The remedy search on the real pretrained sentence transformer (all-MiniLM-L6-v2 from its pip wheel), against
int16 promotion alone (issue #24's first must-show).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_remedies.py [--target 0.99] [--range-sites 8] [--out DIR]
        [--curve docs/remedies_minilm_curve.csv]

Same data and metric as benchmarks/bench_mixed_precision.py (mean embedding cosine vs float on 16 held-out
sentences; calibration 4 x 8 sentences of 16 tokens). Prints the int8 value, each kept remedy, the value without
int16, the int16 sites the search still needed and the final value; then the chosen configuration through
export -> convert (quantized IR vs float) and onnxruntime at its default options (vs float and vs the qat IR).
Writes DIR/remedies.json (and the search's remedies.html / remedies.csv) and the int16 curve to --curve.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
import warnings
from pathlib import Path

import torch

from quantlens.compiler import convert, export, to_onnx
from quantlens.quantization import calibrate, prepare
from quantlens.search.remedies import search_remedies
from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).mean())


def deployed_figures(model, setter, example, calib, evaluation, ref, out: Path) -> dict:
    """The configuration through export -> convert and through onnxruntime (default session options, the qat IR's
    ONNX file), each against float; onnxruntime also against the qat IR."""
    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # all-MiniLM-L6-v2 is transformers' code, without QuantStub
        prepared = calibrate(prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True), calib)
        qat_ir = export(prepared, example)  # static batch (BERT's arange does not export with a dynamic batch)
        q_ir = convert(qat_ir)
    nb = example[0].shape[0]
    chunks = [tuple(t[i:i + nb] for t in evaluation) for i in range(0, evaluation[0].shape[0], nb)]
    with torch.no_grad():
        fq_out = prepared(*evaluation)
        qat_out = torch.cat([qat_ir(*c) for c in chunks])
        q_out = torch.cat([q_ir(*c) for c in chunks])
    path = to_onnx(qat_ir, out / "remedied_qat.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # default options
    names = [i.name for i in sess.get_inputs()]
    ort_out = torch.cat([torch.from_numpy(sess.run(None, {n: qat_ir.feeds(*c)[n].numpy() for n in names})[0])
                         for c in chunks])
    return {"fake_quant_cosine": _cosine(fq_out, ref), "qat_ir_cosine": _cosine(qat_out, ref),
            "quantized_ir_cosine": _cosine(q_out, ref), "onnxruntime_cosine": _cosine(ort_out, ref),
            "onnxruntime_vs_qat_ir_cosine": _cosine(ort_out, qat_out),
            "quantized_ir_latency_cycles": int(q_ir.latency_estimate().cycles)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--range-sites", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench_remedies_out"))
    ap.add_argument("--curve", type=Path, default=None, help="write the int16 curve (CSV) here")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = all_minilm_l6_v2()
    example, calib, evaluation = minilm_data(length=16, calib_batches=4, batch_size=8, eval_size=16)
    with torch.no_grad():
        ref = model(*evaluation)

    def evaluate(prepared) -> float:
        with torch.no_grad():
            return _cosine(prepared(*evaluation), ref)

    started = time.time()
    result = search_remedies(model, example, calib, evaluate, args.target, range_sites=args.range_sites,
                             out_dir=args.out, progress=False)
    before_int16 = [t for t in result.trials if t.kept and t.kind == "int16"]
    summary = {"threads": torch.get_num_threads(), "target": args.target, "int8": result.base_value,
               "transforms": list(result.transforms),
               "no_int16_value": before_int16[0].before if before_int16 else result.value,
               "value": result.value, "observers": result.observers,
               "int16": [f"{p.site} ({p.kind})" for p in result.int16], "int16_count": len(result.int16),
               "kept": [f"{t.kind} {t.name} {t.site} -> {t.value:.4f}" for t in result.trials if t.kept],
               "search_seconds": round(time.time() - started)}
    summary["deployed"] = deployed_figures(result.model, result.setter, example, calib, evaluation, ref, args.out)
    if args.curve is not None:
        with open(args.curve, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["num_int16", "added", "metric"])
            w.writerow([0, "(int8 + the other remedies)", summary["no_int16_value"]])
            for p in result.int16_curve[1:]:
                w.writerow([p.num_int16, "" if p.added is None else p.added.label(), f"{p.metric:.6f}"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remedies.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
