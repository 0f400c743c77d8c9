"""Is there a smaller int16 set than the search's? Every single swap around the best set one site smaller.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_mp_neighbourhood.py --search DIR/search [--target 0.99]

Reads the measurements of a finished ``bench_mixed_precision.py`` run (its ``mixed_precision_progress.json``),
takes the best configuration with one site fewer than the smallest one reaching the target, and measures it with
each of its sites swapped for each candidate outside it (conflict-free; members whose removal costs least first),
stopping at the first that reaches the target. Same model, data and metric as ``bench_mixed_precision.py``;
measurements are cached in ``DIR/neighbourhood.json`` (resumable). Prints a JSON summary. Needs the wheel of
``benchmarks/requirements-mixed-precision.txt``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search import (
    MixedPrecisionQconfigSetter,
    Promotion,
    int16_conflicts,
    mixed_precision_candidates,
)
from quantlens.search.progress import selection_key as _key
from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, minilm_data


def _parse(key: str) -> list[Promotion]:  # the inverse of the progress file's key (search.progress.selection_key)
    return [Promotion(*item.split("|")) for item in key.split(";")] if key else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search", required=True, help="the search folder of a bench_mixed_precision.py run")
    ap.add_argument("--target", type=float, default=0.99)
    args = ap.parse_args()
    search = Path(args.search)
    measured = dict(json.loads((search / "mixed_precision_progress.json").read_text())["measurements"])
    cache = search / "neighbourhood.json"
    if cache.exists():
        measured.update(json.loads(cache.read_text()))
    torch.manual_seed(0)
    model = all_minilm_l6_v2()
    example, calib, evaluation = minilm_data(length=16, calib_batches=4, batch_size=8, eval_size=16)
    with torch.no_grad():
        ref = model(*evaluation)

    def build(selection):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return calibrate(prepare(model, example, MixedPrecisionQconfigSetter(selection,
                                                                                 default_calibration_qconfig_setter),
                                     check_result_dir=None, allow_no_stubs=True), calib)  # no QuantStub

    def measure(selection) -> float:
        key = _key(selection)
        if key not in measured:
            with torch.no_grad():
                out = build(selection)(*evaluation)
            measured[key] = float(torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=1).mean())
            cache.write_text(json.dumps(measured))
        return measured[key]

    size = lambda key: len(key.split(";")) if key else 0  # noqa: E731
    smallest = min(size(k) for k, v in measured.items() if v >= args.target)
    start_key = max((k for k in measured if size(k) == smallest - 1), key=lambda k: measured[k])
    start = _parse(start_key)
    base = build([])
    candidates = mixed_precision_candidates(base)
    removal = {t: measure([x for x in start if x != t]) for t in start}
    members = sorted(start, key=lambda t: -removal[t])  # the least needed first
    outside = [c for c in candidates if c not in start]
    t0, tried, best, found = time.time(), 0, (None, -1.0), None
    for t in members:
        rest = [x for x in start if x != t]
        for c in outside:
            if int16_conflicts(base, rest + [c]):
                continue
            value = measure(rest + [c])
            tried += 1
            if value > best[1]:
                best = ((t.label(), c.label()), value)
            if value >= args.target:
                found = (t.label(), c.label(), value)
                break
        if found:
            break
    summary = {"threads": torch.get_num_threads(), "target": args.target, "smallest_reaching": smallest,
               "start_size": len(start), "start_metric": measured[start_key], "candidates": len(candidates),
               "swaps_measured": tried, "best_swap": best[0], "best_swap_metric": best[1],
               "found": found, "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
