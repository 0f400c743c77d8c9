"""The remedy search on the real pretrained sentence transformer (all-MiniLM-L6-v2 from its pip wheel), against
int16 promotion alone (issue #24's must-show, in progress).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_remedies.py [--target 0.99] [--range-sites 12] [--out DIR]

Same data and metric as benchmarks/bench_mixed_precision.py (mean embedding cosine vs float on 16 held-out
sentences; calibration 4 x 8 sentences of 16 tokens). Prints the int8 value, each kept remedy, the int16 sites the
search still needed and the final value, and writes DIR/remedies.json.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from quantlens.search.remedies import search_remedies
from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--range-sites", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("bench_remedies_out"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = all_minilm_l6_v2()
    example, calib, evaluation = minilm_data(length=16, calib_batches=4, batch_size=8, eval_size=16)
    with torch.no_grad():
        ref = model(*evaluation)

    def evaluate(prepared) -> float:
        out = prepared(*evaluation)
        return float(torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=1).mean())

    started = time.time()
    result = search_remedies(model, example, calib, evaluate, args.target, range_sites=args.range_sites,
                             out_dir=args.out)
    summary = {"threads": torch.get_num_threads(), "target": args.target, "int8": result.base_value,
               "value": result.value, "observers": result.observers,
               "int16": [f"{p.site} ({p.kind})" for p in result.int16], "int16_count": len(result.int16),
               "kept": [f"{t.kind} {t.name} {t.site} -> {t.value:.4f}" for t in result.trials if t.kept],
               "seconds": round(time.time() - started)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remedies.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
