"""Inputs that carry a ``task`` string list (the seed article's 2.3.2), float vs calibration.

``MultiTaskNet.forward(inputs, task)`` takes a dict of tensors plus ``task: list[str]``, which only chooses the
heads (Python ``if``s). The float and the calibration model both need the task list, so the bad case keeps it:
each sample is the ``(inputs_dict, task_list)`` tuple ``model(*sample)`` is called with. Op sites of a head
that does not run are simply absent from both traces. One sensitivity table per head output.

    python examples/03_multitask_task_strings/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path


from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate as calibrate_model, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    float_model = get_model("multitask")
    example = example_inputs("multitask")  # ({"image": ..., "meta": ...}, ["cls", "reg"])
    images_only = ({k: v for k, v in example[0].items()}, ["cls"])
    # Every branch must be seen at prepare: the full task list covers both heads.
    calib = prepare(float_model, example, default_calibration_qconfig_setter, extra_example_inputs=[images_only],
                    check_result_dir=None)
    calibrate_model(calib, sample_batches("multitask", 8, 16))

    summary = {"out_dir": str(out_dir)}
    for tasks in (["cls", "reg"], ["cls"]):
        sub = out_dir / "_".join(tasks)
        qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=sub, progress=progress)
        # The data keeps the task list in every sample: the models need it to pick their branches.
        data = [(inputs, tasks) for inputs, _ in sample_batches("multitask", 6, 4)]
        found = qa.auto_find_bad_case(data)
        qa.run()
        table = qa.compare_per_layer()
        sens = qa.sensitivity()
        summary["_".join(tasks)] = {
            "outputs": found.outputs,
            "op_sites": len(table),
            "sensitivity_tables": sens.keys(),
            "most_sensitive": {t.output: t[0].op_name for t in sens},
        }
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    result = main(parser.parse_args().out)
    for key, value in result.items():
        print(f"{key}: {value}")
