"""The remedy search on real pretrained models from pip wheels, against top-k int16 promotion (issue #24's second
must-show: close at least half of the int8 -> w8a16 gap with fewer int16 op sites than top-k needs).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_remedies_real.py resemblyzer fcpe [--out DIR]

For each model (its own data and task metric, ``quantlens.zoo.third_party``):

1. the metric at int8 (``default_calibration_qconfig_setter``) and at w8a16 (every activation int16);
2. the target: half of the gap, ``int8 + (w8a16 - int8) / 2``;
3. top-k: the k most sensitive op sites of the profiler's one-at-a-time sensitivity promoted to int16, k = 1, 2, ...
   until the target is reached;
4. ``search_remedies`` with the same target: equalization, bias correction, per-site ranges, then int16.

Writes DIR/<model>.json and prints it. Figures in docs/remedies.md.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.search.remedies import search_remedies
from quantlens.zoo.third_party import load_third_party

#: the task metric each model is searched on, and whether higher is better
METRICS = {
    "resemblyzer": ("embedding_cosine_vs_float_mean", True),
    "fcpe": ("pitch_error_vs_float_cents_mean", False),
    "crepe_tiny": ("pitch_error_vs_float_cents_mean", False),
    "pesto_pitch": ("pitch_error_vs_float_cents_mean", False),
    "silero_vad": ("speech_prob_abs_diff_max", False),
    "mtcnn_pnet": ("face_prob_abs_diff_max", False),
}


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def run_model(name: str, out: Path, max_k: int) -> dict:
    entry = load_third_party(name)
    key, higher = METRICS[name]
    model = entry.build().eval()
    example, calib, evaluation, labels = entry.data()
    reference = entry.evaluate(model, evaluation)

    def evaluate(prepared) -> float:
        return float(entry.metric(reference, entry.evaluate(prepared, evaluation), labels)[key])

    def build(setter):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return calibrate(prepare(model, example, setter, check_result_dir=None), calib)

    started = time.time()
    int8_model = build(default_calibration_qconfig_setter)
    int8, w8a16 = evaluate(int8_model), evaluate(build(calibration_8bit_weight_16bit_act_qconfig_setter))
    target = int8 + (w8a16 - int8) / 2
    summary = {"model": name, "metric": key, "higher_is_better": higher, "threads": torch.get_num_threads(),
               "int8": int8, "w8a16": w8a16, "target_half_gap": target}

    qa = QuantAnalysis(model, int8_model, "fake_quant", out_dir=str(out / name / "sensitivity"), progress=False)
    qa.set_bad_case(example)
    sens = qa.sensitivity()
    topk_curve, topk = [], None
    for k in range(1, max_k + 1):
        value = evaluate(build(sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(sens[0], topk=k)))
        topk_curve.append((k, value))
        if _reached(value, target, higher):
            topk = k
            break
    summary.update(topk_int16_sites=topk, topk_curve=topk_curve)

    result = search_remedies(model, example, calib, evaluate, target, higher_is_better=higher,
                             out_dir=out / name / "remedies")
    summary.update(search_value=result.value, search_int16_sites=len(result.int16),
                   search_reached=result.reached(target, higher), search_observers=result.observers,
                   search_int16=[f"{p.site} ({p.kind})" for p in result.int16],
                   search_kept=[f"{t.kind} {t.name} {t.site}: {t.before:.4g} -> {t.value:.4g}"
                                for t in result.trials if t.kept],
                   seconds=round(time.time() - started))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=sorted(METRICS))
    ap.add_argument("--out", type=Path, default=Path("bench_remedies_real_out"))
    ap.add_argument("--max-k", type=int, default=40)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name in args.models:
        summary = run_model(name, args.out, args.max_k)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
