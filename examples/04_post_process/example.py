"""Post-processing in the debug run (the seed article's 2.3.3), float vs calibration.

Two ways to include a detector's post-processing (sigmoid, max over classes, top-k, gather) in the comparison:

1. written into the model: ``DetectorWithPostProcess`` ends its forward with it, after the DeQuantStubs, so
   its ops are op sites and its outputs (scores, boxes, labels) are the model outputs;
2. passed as ``post_process=``: the network alone (``head_only()``) is traced, and the callable runs on both
   models' outputs; its results are compared as ``post_process.<name>`` outputs and as one more row.

In both, the sensitivity ablation gives ``topk``/``max`` the float model's indices, so a flipped top-k choice
does not swamp the ranking. Integer outputs (labels) are not compared.

    python examples/04_post_process/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate as calibrate_model, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches

TOP_K = 5


def post_process(outputs):
    """The detector's host-side post-processing, as a plain function of the raw ``(logits, boxes)``."""
    logits, boxes = outputs
    best, labels = torch.sigmoid(logits).max(dim=-1)
    scores, idx = torch.topk(best, TOP_K, dim=1)
    top_boxes = torch.gather(boxes, 1, idx.unsqueeze(-1).expand(-1, -1, boxes.shape[-1]))
    return {"scores": scores, "boxes": top_boxes, "labels": torch.gather(labels, 1, idx)}


def calibrate(model):
    example = example_inputs("detector_postprocess")
    calib = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches("detector_postprocess", 8, 16))
    return calib


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    bad_case = sample_batches("detector_postprocess", 1, 4)[0]
    summary = {"out_dir": str(out_dir)}

    # 1. Post-processing written into the model.
    with_pp = get_model("detector_postprocess")
    qa = QuantAnalysis(with_pp, calibrate(with_pp), "fake_quant", out_dir=out_dir / "in_model", progress=progress)
    qa.set_bad_case(bad_case)
    qa.run()
    table = qa.compare_per_layer()
    sens = qa.sensitivity()
    summary["in_model"] = {"rows": [r.op_name for r in table][-4:], "tables": sens.keys()}

    # 2. The network alone, post-processing passed to QuantAnalysis.
    head = get_model("detector_postprocess").head_only()
    qa = QuantAnalysis(head, calibrate(head), "fake_quant", out_dir=out_dir / "as_argument",
                       post_process=post_process, progress=progress)
    qa.set_bad_case(bad_case)
    qa.run()
    table = qa.compare_per_layer()
    sens = qa.sensitivity()
    summary["as_argument"] = {"rows": [r.op_name for r in table][-4:], "tables": sens.keys(),
                              "post_process_cosine": table["post_process"].Cosine}
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    result = main(parser.parse_args().out)
    for key, value in result.items():
        print(f"{key}: {value}")
