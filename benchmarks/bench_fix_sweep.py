"""`quantlens fix` on transformers architectures nobody here wrote (quantlens.zoo's builders: tiny random configs,
transformers' module code; benchmarks/configs/arch_fix.py), one after another, and a table of what each ended with.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fix_sweep.py [--target 0.999] [--out DIR] [NAME ...]

A run fails the sweep where the command exits 2 or prints a traceback, a skipped remedy or an unchecked deployed
model: those are the lines the table's last column quotes. A fresh --out folder each run (a folder's measurements
would be replayed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "arch_fix.py"
NAMES = ("bert", "roberta", "distilbert", "electra", "vit", "swin", "convnext", "whisper_encoder", "wav2vec2", "gpt2",
         "bart", "segformer", "roformer", "layoutlm", "data2vec-text")
_FINAL = re.compile(r"target \S+: (reached|NOT reached) \(fake quant ([\d.]+)(?:, deployed quantized IR ([\d.]+))?\)"
                    r" with (\d+) int16")
_PROBLEMS = ("Traceback", "failed and was skipped", "was not checked")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(NAMES))
    ap.add_argument("--target", type=float, default=0.999)
    ap.add_argument("--out", type=Path, default=Path("bench_fix_sweep_out"))
    args = ap.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)  # the benchmark's own folder
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, target {args.target}")
    print(f"{'arch':16} {'exit':>4} {'s':>6} {'fake quant':>10} {'deployed':>10} {'int16':>5}  problems")
    failed = 0
    for name in args.names:
        cmd = [sys.executable, "-m", "quantlens", "fix", str(CONFIG), "--target", str(args.target), "--out",
               str(args.out / name)]
        began = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "QUANTLENS_ARCH": name, "COLUMNS": "200"},
                              capture_output=True, text=True)
        seconds = time.perf_counter() - began
        text = proc.stdout + proc.stderr
        final = _FINAL.search(proc.stdout)
        fake, deployed, int16 = (final.group(2), final.group(3) or "-", final.group(4)) if final else ("-",) * 3
        problems = [line.strip()[:120] for line in text.splitlines() if any(p in line for p in _PROBLEMS)]
        failed += bool(problems) or proc.returncode == 2
        print(f"{name:16} {proc.returncode:>4} {seconds:>6.1f} {fake:>10} {deployed:>10} {int16:>5}  "
              f"{' | '.join(problems[:2])}")
    print(f"{failed} of {len(args.names)} with a problem")


if __name__ == "__main__":
    main()
