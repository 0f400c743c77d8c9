"""The consistency levels measured: quantized IR vs the QAT model, per model x level x qconfig.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_consistency.py [--models ...] [--write docs/consistency.md]

For every zoo model and a transformers ``BertModel`` (a small seeded config: weights random, the module code
transformers' own), at strategy off and levels 0-4, int8 and w8a16: prepare at that level, calibrate (digits: then
a short QAT run on the training images), export, convert, and compare on held-out inputs

* the quantized IR with the QAT model in VALIDATION (what training optimised): exact-match % of output
  elements, the |difference| histogram in output LSB (0 / 1 / 2-4 / >4 steps of each output's own scale), the
  largest difference in LSB and the cosine;
* the quantized IR with the pre_export model in VALIDATION (the QAT model with its lookup tables: the comparison
  "before and after convert" that the seed says the strategy is for; it does nothing for the table conversion):
  exact-match % and the share within 1 output LSB;
* digits only: test accuracy of the QAT model and of the quantized IR;
* the quantized IR's requantize-op count and latency estimate (``Module.latency_estimate``, the march's cost
  model);
* onnxruntime on the qat IR (``to_onnx``), optimizations off and on, against the quantized IR.

``--write FILE`` replaces the generated table between the markers in FILE.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

import quantlens.zoo as zoo
from quantlens.compiler import convert, export, to_onnx
from quantlens.quantization import (
    ConsistencyStrategy,
    FakeQuantState,
    calibrate,
    pre_export,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)

SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}
LEVELS: list[int | None] = [None, 0, 1, 2, 3, 4]
BEGIN, END = "<!-- BEGIN bench_consistency -->", "<!-- END bench_consistency -->"


@dataclass
class Case:
    name: str
    build: object
    example: tuple
    calibration: list
    evaluation: list  # held-out argument tuples
    stubless: bool = False  # third-party code without QuantStub: prepare(..., allow_no_stubs=True)


def _bert_case() -> Case:
    from transformers import BertConfig, BertModel

    class BertEmbedder(torch.nn.Module):
        """transformers' BertModel, unchanged; returns the last hidden state."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=64)
            self.bert = BertModel(config).eval()

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    g = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(0, 500, (8, 16), generator=g)
        mask = torch.ones(8, 16, dtype=torch.long)
        mask[4:, 12:] = 0  # padded sentences
        return ids, mask

    batches = [batch() for _ in range(6)]
    return Case("BertModel", BertEmbedder, batches[0], batches[:4], batches[4:], stubless=True)


def cases(names: list[str]) -> list[Case]:
    out = []
    for name in names:
        if name == "BertModel":
            out.append(_bert_case())
            continue
        batches = zoo.sample_batches(name, 6, 8)
        out.append(Case(name, lambda name=name: zoo.get_model(name), batches[0], batches[:4], batches[4:]))
    return out


def _short_qat(model: torch.nn.Module, epochs: int = 2) -> None:
    """Digits: QAT on the training images (Adam, lr 1e-4, batch 64), then VALIDATION."""
    data = zoo.digits.load_digits_data()
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(data.x_train.shape[0], generator=g)
        for i in range(0, perm.numel(), 64):
            idx = perm[i:i + 64]
            loss = torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)


def _accuracy(fn, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((fn(x).argmax(-1) == y).float().mean()) * 100


def output_lsb(qir) -> list[torch.Tensor | None]:
    """Per model output: the scale of one output step (broadcastable), or None for a float host output."""
    producers = {o: n for n in qir.graph.nodes for o in n.outputs}
    scales = []
    for name in qir.graph.outputs:
        node = producers.get(name)
        if node is None or node.op != "dequantize":
            scales.append(None)
            continue
        s = qir.graph.constants[node.inputs[1]].to(torch.float64)
        axis = node.attrs.get("axis")
        scales.append((s, axis))
    return scales


def compare(reference, outputs, lsb) -> dict:
    ref = [r for r in pytree.tree_leaves(reference) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    out = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    equal = total = 0
    hist = [0, 0, 0, 0]
    worst = 0.0
    dot = nr = no = 0.0
    for i, (r, o) in enumerate(zip(ref, out)):
        r64, o64 = r.to(torch.float64), o.to(torch.float64)
        equal += int((r == o).sum())
        total += r.numel()
        dot += float((r64 * o64).sum())
        nr += float((r64 * r64).sum())
        no += float((o64 * o64).sum())
        step = lsb[i] if i < len(lsb) else None
        if step is None:
            continue
        s, axis = step
        if s.numel() > 1:
            shape = [1] * r.dim()
            shape[axis % r.dim()] = -1
            s = s.reshape(shape)
        steps = torch.round((r64 - o64).abs() / s)
        hist[0] += int((steps == 0).sum())
        hist[1] += int((steps == 1).sum())
        hist[2] += int(((steps >= 2) & (steps <= 4)).sum())
        hist[3] += int((steps > 4).sum())
        worst = max(worst, float(steps.max()) if steps.numel() else 0.0)
    cos = dot / math.sqrt(nr * no) if nr > 0 and no > 0 else 1.0
    counted = sum(hist)
    if not counted:  # float host outputs only: no output grid to count steps on
        return {"exact": 100.0 * equal / max(total, 1), "hist": None, "max_lsb": None, "cos": cos, "within1": None}
    return {"exact": 100.0 * equal / max(total, 1), "hist": [100.0 * h / counted for h in hist], "max_lsb": worst,
            "cos": cos, "within1": 100.0 * (hist[0] + hist[1]) / counted}


def _ort(qat_ir, inputs, optimize: bool):
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = to_onnx(qat_ir, os.path.join(tmp, "model.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                            else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    results = []
    for args in inputs:
        feeds = qat_ir.feeds(*args)
        names = [i.name for i in session.get_inputs()]
        outs = session.run(None, {n: feeds[n].numpy() for n in names})
        results.append([torch.from_numpy(o) for o in outs])
    return results


def measure(case: Case, setter: str, level: int | None, with_onnx: bool) -> dict:
    ConsistencyStrategy.set_consistency_level(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = prepare(case.build(), case.example, SETTERS[setter], check_result_dir=None,
                            allow_no_stubs=case.stubless)
            calibrate(model, case.calibration)
            row: dict = {}
            if case.name == "digits_cnn":
                _short_qat(model)
            qat_ir = export(model, case.example)
            qir = convert(qat_ir)
    finally:
        ConsistencyStrategy.disable()
    with torch.no_grad():
        reference = [model(*args) for args in case.evaluation]
        tabled = pre_export(model)
        reference_pre = [tabled(*args) for args in case.evaluation]
    outputs = [qir(*args) for args in case.evaluation]
    row.update(compare(reference, outputs, output_lsb(qir)))
    row["pre"] = compare(reference_pre, outputs, output_lsb(qir))
    if case.name == "digits_cnn":
        data = zoo.digits.load_digits_data()
        row["acc_qat"] = _accuracy(model, data.x_test, data.y_test)
        row["acc_ir"] = _accuracy(lambda x: _chunked(qir, x, case.example[0].shape[0]), data.x_test, data.y_test)
    estimate = qir.latency_estimate()
    row["requant"] = estimate.requantize_ops
    row["latency_us"] = estimate.microseconds
    if with_onnx:
        for optimize in (False, True):
            onnx_out = _ort(qat_ir, case.evaluation, optimize)
            row["ort_on" if optimize else "ort_off"] = compare(outputs, onnx_out, output_lsb(qir))
    return row


def _chunked(qir, x: torch.Tensor, batch: int) -> torch.Tensor:
    """The IR has a static batch: run full batches, padding the last one."""
    outs = []
    for i in range(0, x.shape[0], batch):
        part = x[i:i + batch]
        pad = batch - part.shape[0]
        if pad:
            part = torch.cat([part, part[:1].expand(pad, *part.shape[1:])])
        outs.append(qir(part)[:batch - pad])
    return torch.cat(outs)


def _level(level) -> str:
    return "off" if level is None else str(level)


def render(results: list[tuple[str, str, int | None, dict]], threads: int, seconds: float) -> str:
    lines = [
        f"Generated by `OMP_NUM_THREADS={threads} .venv/bin/python benchmarks/bench_consistency.py --write "
        f"docs/consistency.md` ({seconds:.0f} s, {threads} torch thread(s)). Quantized IR vs the QAT model in "
        "VALIDATION on held-out inputs (and vs the pre_export model, which holds the lookup tables); LSB = one step of each output's own scale (float host outputs have none); "
        "ORT = onnxruntime on the qat IR vs the quantized IR, optimizations off / on (exact % and max LSB).",
        "",
        "| model | qconfig | level | exact % | \\|diff\\| 0 / 1 / 2-4 / >4 LSB (%) | ≤ 1 LSB % | max LSB | cosine | "
        "vs pre_export: exact %, ≤ 1 LSB % | digits acc QAT / IR | requantize ops | latency (µs) | ORT off | "
        "ORT on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, setter, level, row in results:
        hist = " / ".join(f"{h:.2f}" for h in row["hist"]) if row["hist"] else "(float outputs)"
        worst = f"{row['max_lsb']:.0f}" if row["max_lsb"] is not None else ""
        acc = f"{row['acc_qat']:.2f} / {row['acc_ir']:.2f}" if "acc_qat" in row else ""
        ort = [f"{row[k]['exact']:.2f} %, {row[k]['max_lsb'] or 0:.0f}" if k in row else "" for k in ("ort_off",
                                                                                                    "ort_on")]
        within = f"{row['within1']:.3f}" if row["within1"] is not None else ""
        pre = row["pre"]
        pre_text = f"{pre['exact']:.3f}" + (f", {pre['within1']:.3f}" if pre["within1"] is not None else "")
        lines.append(f"| {name} | {setter} | {_level(level)} | {row['exact']:.3f} | {hist} | {within} | {worst} | "
                     f"{row['cos']:.6f} | {pre_text} | {acc} | {row['requant']} | {row['latency_us']:.3f} | {ort[0]} | {ort[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=zoo.list_models() + ["BertModel"])
    parser.add_argument("--levels", nargs="*", default=[_level(lv) for lv in LEVELS])
    parser.add_argument("--qconfigs", nargs="*", default=list(SETTERS))
    parser.add_argument("--no-onnx", action="store_true")
    parser.add_argument("--write", help="a markdown file whose generated table is replaced")
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    for case in cases(args.models):
        for setter in args.qconfigs:
            for text in args.levels:
                level = None if text == "off" else int(text)
                row = measure(case, setter, level, not args.no_onnx)
                results.append((case.name, setter, level, row))
                within = "n/a" if row["within1"] is None else f"{row['within1']:.3f} %"
                pre = row["pre"]
                pre_within = "n/a" if pre["within1"] is None else f"{pre['within1']:.3f} %"
                print(f"{case.name:22s} {setter:6s} level {_level(level):3s} exact {row['exact']:8.3f} % "
                      f"within1 {within:>9s} vs pre_export {pre['exact']:8.3f} % / {pre_within:>9s} max {row['max_lsb'] or 0:4.0f} LSB cos {row['cos']:.6f} "
                      f"requant {row['requant']:4d} latency {row['latency_us']:9.3f} us"
                      + (f" acc {row['acc_qat']:.2f}/{row['acc_ir']:.2f}" if "acc_qat" in row else ""), flush=True)
    table = render(results, torch.get_num_threads(), time.perf_counter() - start)
    if args.write:
        with open(args.write) as f:
            text = f.read()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{args.write} has no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        from quantlens._io import atomic_write_text

        atomic_write_text(args.write, f"{head}{BEGIN}\n{table}\n{END}{tail}")
    else:
        print(table)


if __name__ == "__main__":
    main()
