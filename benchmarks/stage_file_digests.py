"""sha256 of every file the stages write for the zoo models: to_onnx's default form and its standard QDQ form, and
the saved qat IR and quantized IR (prepare -> calibrate -> pre_export -> export -> convert, torch seeded).

Run it on two checkouts to show a change left the files byte-identical:
    OMP_NUM_THREADS=1 PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/stage_file_digests.py OUT.json
then ``diff`` the two JSON files.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from quantlens.compiler import convert, export, save, to_onnx
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches


def _digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def main() -> None:
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in list_models():
            torch.manual_seed(0)
            calib = prepare(get_model(name), example_inputs(name), check_result_dir=None)
            calibrate(calib, sample_batches(name, 3, 8))
            qat_ir = export(pre_export(calib), example_inputs(name))
            quantized = convert(qat_ir)
            writers = {"onnx": lambda p: to_onnx(qat_ir, p), "onnx_qdq": lambda p: to_onnx(qat_ir, p, standard_qdq=True),
                       "qat_ir": lambda p: save(qat_ir, p), "quantized_ir": lambda p: save(quantized, p)}
            for label, write in writers.items():
                path = Path(tmp) / f"{name}.{label}"
                write(path)
                out[f"{name}/{label}"] = _digest(path)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
