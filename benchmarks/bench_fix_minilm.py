"""`quantlens fix` on all-MiniLM-L6-v2 with issue #46's protocol (benchmarks/configs/minilm_fix.py), timed from the
command to the chosen configuration.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fix_minilm.py [--out DIR] [--target 0.99] [--qat]
        [--consistency-level off|0|...] [--no-deployed]

Prints the command's console (the kept remedies, the time of each step of the search) and its wall time. A fresh
--out folder each run: the search replays a folder's measurements. ``--deployed-figures`` then loads the chosen
configuration (``load_remedies``) at the same consistency level and prints it deployed: fake quant, qat IR,
quantized IR and onnxruntime (default session options) against float (``bench_remedies.deployed_figures``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "minilm_fix.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_fix_minilm_out"))
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--qat", action="store_true")
    ap.add_argument("--consistency-level", default=None, help="quantlens fix's (default: its own)")
    ap.add_argument("--no-deployed", action="store_true")
    ap.add_argument("--deployed-figures", action="store_true")
    args = ap.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)  # the benchmark's own folder: a replay would time nothing
    cmd = [sys.executable, "-m", "quantlens", "fix", str(CONFIG), "--target", str(args.target), "--out",
           str(args.out)] + (["--qat"] if args.qat else []) + (["--no-deployed"] if args.no_deployed else []) + (
               ["--consistency-level", args.consistency_level] if args.consistency_level else [])
    env = {**os.environ, "COLUMNS": "160"}
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    print(proc.stdout[-6000:])
    if proc.returncode not in (0, 1):
        print(proc.stderr[-3000:])
    print(f"quantlens fix: exit {proc.returncode}, {seconds:.1f} s wall, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if args.deployed_figures and proc.returncode in (0, 1):
        print(_deployed(args.out, args.consistency_level or ("1" if args.qat else "off")))


def _deployed(out: Path, level: str) -> dict:
    """The saved configuration through export -> convert and onnxruntime, at the level the search ran at."""
    import importlib.util
    import warnings

    import torch
    from bench_remedies import deployed_figures

    from quantlens.quantization import ConsistencyStrategy
    from quantlens.search.remedies import load_remedies

    spec = importlib.util.spec_from_file_location("minilm_fix", CONFIG)
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ConsistencyStrategy.set_consistency_level(None if level == "off" else int(level))
    model = cfg.float_model()
    remedied, setter = load_remedies(model, out, cfg.calibration_qconfig_setter)
    (held,) = cfg.evaluation_data()
    with torch.no_grad():
        ref = model(*held)
    return deployed_figures(remedied, setter, cfg.example_inputs(), cfg.calibration_data(), held, ref, out)


if __name__ == "__main__":
    main()
