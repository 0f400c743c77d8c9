"""`quantlens fix` on all-MiniLM-L6-v2 with issue #46's protocol (benchmarks/configs/minilm_fix.py), timed from the
command to the chosen configuration.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fix_minilm.py [--out DIR] [--target 0.99] [--qat]
        [--consistency-level off|0|...] [--no-deployed]

Prints the command's console (the kept remedies, the time of each step of the search) and its wall time. A fresh
--out folder each run: the search replays a folder's measurements.
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


if __name__ == "__main__":
    main()
