"""The floor under quantlens' per-layer analysis at one thread, against torchao's whole comparison (issue #25).

    OMP_NUM_THREADS=1 .venv/bin/python -W ignore benchmarks/bench_analysis_floor.py [--nets resnet18,minilm]
        [--repeats 5]

What ``run()`` + ``compare_per_layer()`` must compute, whatever the implementation, measured as plain torch at 1
thread on ``bench_peers``' nets and inputs. Each part is the best of ``--repeats`` calls; the floor is their sum:

* **baseline forward**: the float model's forward, forward hooks keeping every compared module's input and output
  (references, no copies);
* **analysis forward**: the calibrated fake-quant model's forward (the "fake_quant" analysis), hooks keeping the
  same modules' outputs;
* **same-input runs**: each compared module of the analysis model run once more, on the baseline's input of it
  (the "same-input" error that tells what an op adds by itself: the figure quantlens has and the peers do not);
  a fused group's modules each once;
* **figures**: for every row of quantlens' ``compare_per_layer()`` with a number, the figures every such row shows:
  of the accumulated pair Cosine, MSE, L1, KL (softmax over the channels), SQNR and Atol; of the same-input pair
  Cosine, SQNR and Atol. Whole-tensor float32 torch ops, the fewest passes torch offers (``dot``, ``vector_norm``,
  one difference per pair, two ``log_softmax``), no float64, no per-channel figures, no error split. The values
  are quantlens' own (its traces of one run, read into memory before the timing).

It leaves out, so the real floor is higher: the same-input runs of ops that are not modules (residual adds,
matmuls, softmax in a transformer's code), every file (traces, statistics, reports), the traced forward's own work
(op names, the stubs' and fused groups' bookkeeping), per-channel figures, the same-input error's split and its
LSB figures.

Measured side by side in the same process: quantlens' ``run()`` + ``compare_per_layer()`` and torchao's pt2e
numeric debugger (``bench_peers_tools``; a peer not installed is skipped: ``bench_peers.py --setup``). Two float
forwards are the common denominator. quantlens' trace writer works on a second thread, so its own time may fall
below this one-thread floor; the floor says what one core must do.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers_nets import NETS, Net, build_net  # noqa: E402
from bench_peers_tools import calibrated, setup_quantlens, setup_torchao  # noqa: E402


def _best(fn, repeats: int):
    best, out = math.inf, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _capture(model: torch.nn.Module, names: list[str], inputs: bool) -> tuple[dict, list]:
    """Forward hooks on ``model``'s modules ``names`` keeping (inputs, output) by name: references, no copies."""
    got: dict[str, tuple] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in names:
        def hook(_module, args, out, name=name):
            got[name] = (args if inputs else None, out)
        handles.append(modules[name].register_forward_hook(hook))
    return got, handles


def _figures(x: torch.Tensor, y: torch.Tensor, s: torch.Tensor | None) -> tuple[float, ...]:
    """Every row's figures of the accumulated pair (x, y) and the same-input pair (x, s; none without ``s``), in
    float32."""
    x, y = x.detach().float(), y.detach().float()
    fx, fy = x.reshape(-1), y.reshape(-1)
    n = fx.numel()
    xx, yy, xy = float(torch.dot(fx, fx)), float(torch.dot(fy, fy)), float(torch.dot(fx, fy))
    d = fy - fx
    dd, l1, atol = float(torch.dot(d, d)), float(torch.linalg.vector_norm(d, 1)), float(d.abs().amax())
    dim = 1 if x.dim() > 2 else x.dim() - 1
    lp, lq = torch.log_softmax(x, dim), torch.log_softmax(y, dim)
    kl = float(lp.exp().mul_(lp.sub_(lq)).sum()) / max(n // x.shape[dim], 1)
    cos = xy / math.sqrt(xx * yy) if xx * yy > 0 else math.nan
    sqnr = 10 * math.log10(xx / dd) if dd > 0 and xx > 0 else math.inf
    if s is None:
        return cos, dd / n, l1 / n, kl, sqnr, atol
    fs = s.detach().float().reshape(-1)
    ss, xs = float(torch.dot(fs, fs)), float(torch.dot(fx, fs))
    e = fs - fx
    ee, same_atol = float(torch.dot(e, e)), float(e.abs().amax())
    same_cos = xs / math.sqrt(xx * ss) if xx * ss > 0 else math.nan
    same_sqnr = 10 * math.log10(xx / ee) if ee > 0 and xx > 0 else math.inf
    return cos, dd / n, l1 / n, kl, sqnr, atol, same_cos, same_sqnr, same_atol


def floor(net: Net, analysis: torch.nn.Module, rows: dict[str, list[str]], values: list[tuple], repeats: int
          ) -> dict[str, float]:
    """The floor's parts (seconds) on ``net``: ``rows`` (module name -> the modules whose same-input run makes its
    value: a fused group's members and itself) are re-run on the baseline's inputs; ``values``: every numbered
    row's (baseline, analysis, same-input or None) values, whose figures are computed."""
    modules = dict(analysis.named_modules())
    runs = sorted({m for group in rows.values() for m in group})
    parts: dict[str, float] = {}
    with torch.no_grad():
        got_b, handles = _capture(net.model, runs, inputs=True)
        parts["baseline forward"], _ = _best(lambda: net.model(*net.args), repeats)
        for h in handles:
            h.remove()
        got_a, handles = _capture(analysis, list(rows), inputs=False)
        parts["analysis forward"], _ = _best(lambda: analysis(*net.args), repeats)
        for h in handles:
            h.remove()
        # (each module of a fused group on its own baseline input: the group's GEMM and the rest, once each)
        parts["same-input runs"], same = _best(lambda: {m: modules[m](*got_b[m][0]) for m in runs}, repeats)
        parts["figures"], _ = _best(lambda: [_figures(*t) for t in values], repeats)
    return parts


def _rows(net: Net, analysis: torch.nn.Module) -> tuple[dict[str, list[str]], list[tuple], int]:
    """What the floor computes, from one quantlens run: the rows whose same-input run it repeats (quantlens' rows
    with an SQNR whose op is a module of both models with one float output of the same shape on both sides, each
    with the modules of its fused group, the row's own last); every row with an SQNR's values from quantlens'
    traces (baseline, analysis and same-input outputs, float32, in memory; the first output of a row with several);
    and how many rows quantlens has in all."""
    import tempfile

    from quantlens.profiler import QuantAnalysis
    from quantlens.profiler.trace import TraceReader

    with tempfile.TemporaryDirectory() as out:
        qa = QuantAnalysis(net.model, analysis, "fake_quant", out_dir=out, progress=False)
        qa.set_bad_case(net.args)
        qa.run()
        table = qa.compare_per_layer()
        base, analy = TraceReader(Path(out) / "baseline_model"), TraceReader(Path(out) / "analysis_model")
        values = []
        for r in table:
            if r.SQNR is None:
                continue
            bt, at = base.tensors(r.op_name), analy.tensors(r.op_name)
            same = at["same0"].float().clone() if "same0" in at else None
            values.append((bt["out0"].float().clone(), at["out0"].float().clone(), same))
    float_mods, analy_mods = dict(net.model.named_modules()), dict(analysis.named_modules())
    names = [r.op_name for r in table if r.SQNR is not None and r.op_name in float_mods and r.op_name in analy_mods]
    got_b, hb = _capture(net.model, names, inputs=True)
    got_a, ha = _capture(analysis, names, inputs=False)
    with torch.no_grad():
        net.model(*net.args)
        analysis(*net.args)
    for h in hb + ha:
        h.remove()
    keep = [k for k in names if k in got_b and k in got_a and isinstance(got_b[k][1], torch.Tensor)
            and isinstance(got_a[k][1], torch.Tensor) and got_b[k][1].is_floating_point()
            and got_b[k][1].shape == got_a[k][1].shape]
    members: dict[str, list[str]] = {}
    for r in table:
        if r.fused_into and r.op_name in float_mods and r.op_name in analy_mods:
            members.setdefault(r.fused_into, []).append(r.op_name)
    return {k: members.get(k, []) + [k] for k in keep}, values, len(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; best of {args.repeats}; ms, and x two "
          "float forwards")
    for name in args.nets.split(","):
        torch.manual_seed(0)
        net = build_net(name)
        analysis = calibrated(net)
        rows, values, total = _rows(net, analysis)
        with torch.no_grad():
            two, _ = _best(lambda: (net.model(*net.args), net.model(*net.args)), max(args.repeats, 10))
        parts = floor(net, analysis, rows, values, args.repeats)
        low = sum(parts.values())
        tools = {"quantlens run() + compare_per_layer()": setup_quantlens(net)}
        try:
            tools["torchao pt2e numeric debugger"] = setup_torchao(net)
        except ImportError as exc:
            print(f"  (torchao not installed: {exc}; bench_peers.py --setup)")
        measured = {}
        for label, fn in tools.items():
            fn()  # warm-up
            measured[label], _ = _best(fn, args.repeats)
        print(f"\n{name}: two float forwards {two * 1e3:.1f} ms; of quantlens' {total} rows the floor computes the "
              f"figures of {len(values)} (those with a number), the same-input runs of {len(rows)} (the modules' ones)")
        for part, sec in parts.items():
            print(f"  floor: {part:<18} {sec * 1e3:8.1f} ms  {sec / two:5.2f}x")
        print(f"  floor: {'sum':<18} {low * 1e3:8.1f} ms  {low / two:5.2f}x")
        for label, sec in measured.items():
            print(f"  {label:<40} {sec * 1e3:8.1f} ms  {sec / two:5.2f}x  (floor / it: {low / sec:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
