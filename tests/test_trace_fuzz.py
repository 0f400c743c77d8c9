"""A seeded fuzz of the trace folder as untrusted input (docs/guarantees.md, "A trace folder is read as untrusted
input"). One small model is traced once; each case damages a copy of its out_dir (trace.json bytes and values, the
tensor files, links, FIFOs, folders in place of files, ``quantlens_pair.json``) and reads it back through both
public readers, ``QuantAnalysis.set_model_profiler_dir`` + ``compare_per_layer`` and ``quantlens report``, each in
a worker thread under a time limit (a hang fails).

Every outcome is one of:

* a ``QuantLensError`` (``quantlens report`` also: its ``UsageError``) whose message names the damaged folder;
* the result of the undamaged folder, exactly;
* only for damage no reader can tell from a real trace (a number changed within its valid range, a flipped bit in
  tensor data that keeps the recorded statistics, an optional key dropped): a complete, different result.

Any other exception (KeyError, JSONDecodeError, SafetensorError, TypeError ...) fails. Each case says which of the
three it allows: ``ERROR`` (the damage is always detectable: only the error), ``STRICT`` (the error, or the same
result where the damaged part is not read), ``LENIENT`` (any of the three).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from quantlens.cli import UsageError, build_parser
from quantlens.cli.pipeline import PAIR_FILE
from quantlens.errors import QuantLensError
from quantlens.profiler.compare_cache import COMPARISON_FILE
from tests.test_profiler_reach import _analysis

SEED = 2604
N_CASES = int(os.environ.get("QUANTLENS_FUZZ_CASES", "60"))  # more for a deeper run
CASE_TIMEOUT = 30.0  # seconds per read; the whole case takes well under one
SIDES = ("baseline_model", "analysis_model")
ERROR, STRICT, LENIENT = "error", "strict", "lenient"
#: a tensor file compare_per_layer always reads on both sides (fc2's outputs and same-input outputs)
READ_FILE = "tensors/00007.safetensors"


# -- the two readers ---------------------------------------------------------------------------------------------
def _via_api(qa, folder: Path) -> str:
    qa.set_model_profiler_dir(folder / "baseline_model", folder / "analysis_model")
    table = qa.compare_per_layer()
    return json.dumps([table.to_dicts(), table.only_in_baseline, table.only_in_analysis, table.baseline,
                       table.analysis], sort_keys=True, default=str)


def _via_cli(qa, folder: Path) -> str:
    args = build_parser().parse_args(["report", str(folder)])
    with contextlib.redirect_stdout(io.StringIO()):
        code = args.func(args)
    texts = [(folder / name).read_text() for name in ("compare_per_layer_out.csv", "abnormal_layer_advisor.txt")]
    return json.dumps([code, *texts])


READERS = {"cli": _via_cli, "api": _via_api}  # (the api last: a case may end in its xfail, see _judge)


def _bounded(fn, *args):
    """``("ok", value)``, ``("raised", exception)`` or ``("hang", None)`` of ``fn(*args)`` run in a worker thread."""
    box: dict = {}

    def work():
        try:
            box["ok"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - judged by the caller
            box["raised"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(CASE_TIMEOUT)
    if thread.is_alive():
        return "hang", None
    return next(iter(box.items()))


def _release(fifos: list[Path]) -> None:
    """Open each FIFO's writing end once, so that a reader blocked on it gets end of file and its thread ends."""
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


# -- the traced folder -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The analysis of one small model (traced once), a pristine copy of its folder and both readers' results."""
    root = tmp_path_factory.mktemp("fuzz").resolve()
    qa = _analysis(root / "run")
    meta = {"analysis_type": "fake_quant", "baseline": "float", "analysis": "calibration",
            "fake_quant_state": qa.analysis.fake_quant_state,
            "consistency": asdict(qa.consistency) if qa.consistency is not None else None, "onnxruntime": None}
    pristine = root / "pristine"
    for side in SIDES:
        shutil.copytree(root / "run" / side, pristine / side)
    (pristine / PAIR_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    ref = _fresh(root, "ref", pristine)
    expected = {name: fn(qa, ref) for name, fn in READERS.items()}
    return qa, root, pristine, expected


def _fresh(root: Path, name: str, pristine: Path) -> Path:
    folder = root / name / "qa"  # one folder name for every copy: the reports name it
    shutil.copytree(pristine, folder, symlinks=True)
    return folder


def test_the_undamaged_copy_gives_the_run_s_comparison(traced):
    qa, root, pristine, expected = traced
    rows = json.loads(expected["api"])[0]
    assert [r["op_name"] for r in rows][:3] == ["quant", "fc1", "relu_0"] and len(rows) == 10
    assert any(r["same_input_sqnr"] is not None for r in rows)
    again = _fresh(root, "again", pristine)
    assert {name: fn(qa, again) for name, fn in READERS.items()} == expected


# -- damage ------------------------------------------------------------------------------------------------------
def _index(folder: Path, side: str) -> tuple[Path, dict]:
    path = folder / side / "trace.json"
    return path, json.loads(path.read_text())


def _site(rng, data: dict, want=lambda s: True) -> dict:
    return rng.choice([s for s in data["sites"] if want(s)])


def _stored(folder: Path, side: str) -> list[str]:
    return sorted(f"tensors/{p.name}" for p in (folder / side / "tensors").iterdir())


def _target(rng, folder: Path, side: str, sure: bool) -> tuple[str, str]:
    """A file of the trace to replace, and the level: one always read (trace.json, fc2's file) or any file."""
    if sure:
        return rng.choice(["trace.json", READ_FILE]), ERROR
    return rng.choice(["outputs.safetensors", *_stored(folder, side)]), STRICT


STAT = {"shape": [2], "dtype": "float32", "min": 0.0, "max": 1.0, "mean": 0.5, "var": 0.1, "nan": 0, "inf": 0}
WRONG_SITE = {  # a site field -> values of a wrong type or out of range
    "index": ["3", 1.5, None, -1, True], "name": [5, None, ["fc2"]], "op_type": [5, None, {}],
    "module_type": [5, ["Linear"]], "file": [5, None, ["tensors/00000.safetensors"], ""], "quant_dtype": [8, None],
    "scale": ["0.1", [], ["a"], {}, -0.5, True], "weight_scale": ["0.1", [], [None], -1.0],
    "input_dtypes": ["float32", [1], {}], "boundary": [1, None], "fused_into": [1, ["relu_0"]], "producer": [1, {}],
    "index_producing": ["yes", 1, None], "stats": [[], "x", {"out0": []}, {"bogus": STAT}, {"out0": 1}],
    "quant_error": ["x", [], {"raw_min": 1.0}, {"raw_min": "a", "raw_max": 1.0, "numel": 1, "clipped": 0,
                                                  "clip_sq_err": 0.0, "round_sq_err": 0.0, "qmin": 0, "qmax": 1}],
    "same_input_note": [1, None], "int_stats": ["x", {"acc_saturated": -1}, {"nope": 1}], "scale_axis": ["0", 1.5, []],
    "refs": [[], "x", {"in0": "ab"}, {"in0": ["tensors/00000.safetensors"]}, {"in0": [1, 2]}, {"in0": ["a", "b", "c"]}],
    "codes": [[], {"out0": "x"}, {"out0": -1.0}, {"out0": 0.0}, {"out0": None}], "stats_only": ["out0", [1], {}],
}
WRONG_STAT = {"shape": ["4", [-1, 4], [1.5], None, [True]], "dtype": [5, None], "min": ["x", []], "max": [{}, "0"],
              "mean": ["x"], "var": [[1.0]], "nan": [-1, "0", 1.5], "inf": [-2, None]}
WRONG_TOP = {"format": [1, "2", None, 3], "model": [5, None], "description": [5], "input_digest": [5, None],
             "model_digest": [5, []], "outputs": ["0", [1], {}], "sites": [{}, "x", [1], [None]]}
REQUIRED_SITE = ("index", "name", "op_type", "module_type", "file")
REQUIRED_STAT = ("shape", "dtype", "min", "max", "mean", "var")
REQUIRED_TOP = ("format", "model", "description", "outputs", "sites")


def json_wrong_type(rng, folder, side):
    path, data = _index(folder, side)
    where = rng.choice(["top", "site", "site", "stat"])
    if where == "top":
        key = rng.choice(sorted(WRONG_TOP))
        value = data[key] = rng.choice(WRONG_TOP[key])
    elif where == "site":
        key = rng.choice(sorted(WRONG_SITE))
        value = _site(rng, data)[key] = rng.choice(WRONG_SITE[key])
    else:
        stats = _site(rng, data)["stats"]
        key = rng.choice(sorted(WRONG_STAT))
        value = stats[rng.choice(sorted(stats))][key] = rng.choice(WRONG_STAT[key])
    path.write_text(json.dumps(data))
    return f"{side} trace.json {where} {key} = {value!r}", ERROR


def json_numbers(rng, folder, side):
    """Negative and huge numbers: refused where out of range; where in range, only what reads them can tell."""
    path, data = _index(folder, side)
    choices = [("index", -1, ERROR), ("index", 10**30, LENIENT), ("shape", -3, ERROR), ("shape", 10**12, LENIENT),
               ("nan", -5, ERROR), ("scale", -0.25, ERROR), ("scale", 1e300, LENIENT), ("min", 1e308, LENIENT)]
    if side == "analysis_model":
        choices += [("codes", -1.0, ERROR), ("codes", 1e30, ERROR), ("codes", float("inf"), ERROR)]
    key, value, level = rng.choice(choices)
    site = _site(rng, data, lambda s: s["codes"]) if key == "codes" else _site(rng, data)
    stat = site["stats"][rng.choice(sorted(site["stats"]))]
    if key == "shape":
        stat["shape"] = [value, *stat["shape"][1:]]
    elif key in ("nan", "min"):
        stat[key] = value
    elif key == "codes":
        site["codes"] = {k: value for k in site["codes"]}
    else:
        site[key] = value
    path.write_text(json.dumps(data))
    return f"{side} trace.json site {site['name']} {key} = {value!r}", level


def json_paths(rng, folder, side):
    """Paths out of the folder, absolute paths (even to the folder's own file), in ``file`` or a reference."""
    path, data = _index(folder, side)
    site = _site(rng, data, lambda s: s["refs"]) if rng.random() < 0.5 else _site(rng, data)
    own = site["file"]
    bad = rng.choice([f"../{SIDES[0]}/{own}", "../../../../etc/passwd", f"tensors/../../{SIDES[1]}/{own}",
                      "/etc/passwd", str(folder / side / own), "..", "tensors/../../qa/../x"])
    if site["refs"] and rng.random() < 0.5:
        key = rng.choice(sorted(site["refs"]))
        site["refs"][key][0] = bad
    else:
        site["file"] = bad
    path.write_text(json.dumps(data))
    return f"{side} trace.json site {site['name']} names {bad!r}", ERROR


def json_missing_key(rng, folder, side):
    path, data = _index(folder, side)
    where = rng.choice(["top", "site", "stat"])
    if where == "top":
        holder, required = data, REQUIRED_TOP
    elif where == "site":
        holder, required = _site(rng, data), REQUIRED_SITE
    else:
        stats = _site(rng, data)["stats"]
        holder, required = stats[rng.choice(sorted(stats))], REQUIRED_STAT
    key = rng.choice(sorted(holder))
    del holder[key]
    path.write_text(json.dumps(data))
    # an optional key takes its default (older traces lack it): a trace cannot tell that from a real one
    return f"{side} trace.json {where} without {key}", ERROR if key in required else LENIENT


def json_extra_key(rng, folder, side):
    path, data = _index(folder, side)
    where = rng.choice(["top", "site", "stat"])
    holder = data if where == "top" else _site(rng, data)
    if where == "stat":
        holder = holder["stats"][rng.choice(sorted(holder["stats"]))]
    holder[rng.choice(["extra", "__class__", "file2"])] = rng.choice([1, "x", None, [1]])
    path.write_text(json.dumps(data))
    return f"{side} trace.json {where} with an extra key", STRICT


def json_swap_entries(rng, folder, side):
    path, data = _index(folder, side)
    a, b = rng.sample(data["sites"], 2)
    field = rng.choice(["file", "stats", "codes", "refs"])
    a[field], b[field] = b[field], a[field]
    path.write_text(json.dumps(data))
    # (each is read for a compared site unless both sites' rows never load them)
    return f"{side} trace.json sites {a['name']} and {b['name']} swap {field}", STRICT


def json_bytes(rng, folder, side):
    """Random byte flips or a truncation of trace.json: an unreadable index is refused; one that still parses is
    judged like any edit (a changed digit of a statistic is indistinguishable from a real value)."""
    path = folder / side / "trace.json"
    raw = bytearray(path.read_bytes())
    if rng.random() < 0.3:
        cut = rng.randrange(len(raw))
        raw, what = raw[:cut], f"truncated at {cut}"
    else:
        spots = [rng.randrange(len(raw)) for _ in range(rng.randint(1, 4))]
        for i in spots:
            raw[i] ^= rng.randint(1, 255)
        what = f"bytes flipped at {spots}"
    path.write_bytes(bytes(raw))
    try:
        json.loads(raw)
    except ValueError:
        return f"{side} trace.json {what} (no longer JSON)", ERROR
    return f"{side} trace.json {what} (still JSON)", LENIENT


def json_rename(rng, folder, side):
    """A site renamed on one side (the two traces no longer correspond: refused), or two sites' names exchanged
    (a consistent trace of another model: only what reads it can tell)."""
    path, data = _index(folder, side)
    a, b = rng.sample(data["sites"], 2)
    if rng.random() < 0.6:
        old, a["name"] = a["name"], a["name"] + rng.choice(["X", "_1", ".0", " "])
        what, level = f"site {old} renamed {a['name']!r}", ERROR
    else:
        a["name"], b["name"] = b["name"], a["name"]
        what, level = f"sites {a['name']} and {b['name']} exchange their names", LENIENT
    path.write_text(json.dumps(data))
    return f"{side} trace.json {what}", level


def swap_files(rng, folder, side):
    """Two tensor files exchanged, within one trace or between the two."""
    other = rng.choice(SIDES)
    a = folder / side / rng.choice(_stored(folder, side))
    b = folder / other / (READ_FILE if rng.random() < 0.5 else rng.choice(_stored(folder, other)))
    if a == b:
        b = folder / side / "tensors/00003.safetensors" if a.name != "00003.safetensors" else folder / side / READ_FILE
    tmp = a.with_name("swap.tmp")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    return f"{a.relative_to(folder)} swapped with {b.relative_to(folder)}", STRICT


def _header_len(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def damage_file(rng, folder, side):
    """A tensor file truncated, zeroed, emptied, or with flipped bytes in its header or its data."""
    name = READ_FILE if rng.random() < 0.5 else rng.choice(["outputs.safetensors", *_stored(folder, side)])
    path = folder / side / name
    raw = bytearray(path.read_bytes())
    head = _header_len(path)
    how = rng.choice(["truncate", "zero", "empty", "header", "data"])
    level = ERROR if name == READ_FILE else STRICT
    if how == "truncate":
        raw = raw[:rng.randrange(len(raw))]
    elif how == "zero":
        raw = bytearray(len(raw))
    elif how == "empty":
        raw = bytearray()
    else:
        lo, hi = (0, head) if how == "header" else (head, len(raw))
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(lo, hi)] ^= rng.randint(1, 255)
        # a flipped header byte breaks the file or names what is not there (or leaves an unread key or padding
        # changed); a flipped data byte that keeps the tensor's recorded statistics cannot be told from a value
        level = STRICT if how == "header" else LENIENT
    path.write_bytes(bytes(raw))
    return f"{side}/{name} {how}", level


def symlink(rng, folder, side):
    outside = folder.parent / "outside.bin"
    outside.write_bytes(b"not a trace file")
    sure = rng.random() < 0.5
    name, level = _target(rng, folder, side, sure)
    path = folder / side / name
    where = rng.choice(["outside file", "dangling", "directory", "other file inside", "own pristine copy"])
    link = {"outside file": outside, "dangling": folder / side / "missing.bin", "directory": folder / side / "tensors",
            "other file inside": folder / side / "tensors/00003.safetensors",
            "own pristine copy": folder.parent.parent / "pristine" / side / name}[where]
    if link == path.resolve():
        link = folder / side / "tensors/00001.safetensors"
    path.unlink()
    path.symlink_to(link)
    return f"{side}/{name} is a link to {where}", level


def symlink_folder(rng, folder, side):
    """A whole folder of the trace replaced by a link: to another trace (refused by its label), to a copy
    outside (the same trace: read as it is), or ``tensors/`` to one outside (refused: files out of the folder)."""
    pristine = folder.parent.parent / "pristine"
    how = rng.choice(["other side", "outside copy", "tensors outside"])
    if how == "tensors outside":
        shutil.rmtree(folder / side / "tensors")
        (folder / side / "tensors").symlink_to(pristine / side / "tensors")
        return f"{side}/tensors links to a copy outside", ERROR
    shutil.rmtree(folder / side)
    (folder / side).symlink_to(folder / SIDES[1 - SIDES.index(side)] if how == "other side" else pristine / side)
    return f"{side} links to the {how}", ERROR if how == "other side" else STRICT


def fifo(rng, folder, side):
    name, level = _target(rng, folder, side, rng.random() < 0.6)
    path = folder / side / name
    path.unlink()
    os.mkfifo(path)
    return f"{side}/{name} is a FIFO", level


def directory(rng, folder, side):
    if rng.random() < 0.25:
        shutil.rmtree(folder / side / "tensors")
        (folder / side / "tensors").write_bytes(b"a file where the tensors' folder was")
        return f"{side}/tensors is a file", ERROR
    name, level = _target(rng, folder, side, rng.random() < 0.6)
    path = folder / side / name
    path.unlink()
    path.mkdir()
    (path / "inner.safetensors").write_bytes(b"\0" * 16)
    return f"{side}/{name} is a directory", level


def pair_file(rng, folder, side):
    """``quantlens_pair.json`` (read by ``quantlens report`` only) damaged: the report refuses it, naming it."""
    path = folder / PAIR_FILE
    meta = json.loads(path.read_text())
    how = rng.choice(["garbage", "list", "analysis_type", "consistency", "names", "fifo", "directory"])
    if how == "garbage":
        path.write_bytes(b"{\"analysis_type\": \"fake_q\xff")
    elif how == "list":
        path.write_text("[1, 2]")
    elif how in ("fifo", "directory"):
        path.unlink()
        os.mkfifo(path) if how == "fifo" else path.mkdir()
    else:
        key, value = {"analysis_type": ("analysis_type", rng.choice([5, "nope", None, ["fake_quant"]])),
                      "consistency": ("consistency", rng.choice([5, "x", [], {"bogus": 1}, {"level": "x"},
                                                                  {"known": "yes", "qpp": 3}])),
                      "names": (rng.choice(["baseline", "analysis", "fake_quant_state", "onnxruntime"]),
                                rng.choice([5, [], {"x": 1}]))}[how]
        meta[key] = value
        how = f"{key} = {value!r}"
        path.write_text(json.dumps(meta))
    return f"{PAIR_FILE} {how}", {"api": STRICT, "cli": ERROR}


def comparison_cache(rng, folder, side):
    """``compare_per_layer.json`` (the rows ``quantlens report`` saved, keyed by both trace.json digests; read by the
    report only) put next to the traces, intact or damaged: read back when it belongs to these traces, else
    recomputed; a damaged one is recomputed too, or refused. Rows edited within their types, the digests intact,
    cannot be told from the saved ones."""
    path = folder / COMPARISON_FILE
    data = json.loads((folder.parent.parent / "ref" / "qa" / COMPARISON_FILE).read_text())
    how = rng.choice(["intact", "bytes", "digest", "row type", "row value", "row removed", "fifo", "directory"])
    level, row = STRICT, rng.choice(data["rows"])
    if how == "digest":
        data["traces"][rng.randrange(2)] = "0" * 64
    elif how == "row type":
        key = rng.choice(sorted(row))
        row[key] = rng.choice([[1], {"x": 1}, "x"] if isinstance(row[key], (int, float, type(None))) else [5, [1]])
        how = f"row {row['op_name']} {key} = {row[key]!r}"
        level = STRICT  # a value of another type: the saved rows are not used, the traces are compared again
    elif how == "row value":
        key = rng.choice([k for k, v in sorted(row.items()) if isinstance(v, float)])
        row[key], level = rng.choice([0.0, -1.0, 1e30]), LENIENT
        how = f"row {row['op_name']} {key} = {row[key]!r}"
    elif how == "row removed":
        data["rows"].remove(row)
        level = LENIENT
    text = json.dumps(data, sort_keys=True)
    if how == "bytes":
        raw = bytearray(text.encode())
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] ^= rng.randint(1, 255)
        text = raw.decode("latin-1")
        try:
            json.loads(raw)
            level = LENIENT
        except ValueError:
            pass
    if how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    else:
        path.write_text(text, encoding="latin-1" if how == "bytes" else "utf-8")
    return f"{COMPARISON_FILE} {how}", {"api": STRICT, "cli": level}


KINDS = [json_wrong_type, json_numbers, json_paths, json_missing_key, json_extra_key, json_swap_entries, json_bytes,
         swap_files, damage_file, symlink, symlink_folder, fifo, directory, pair_file, json_wrong_type, json_bytes,
         damage_file, fifo, symlink, json_paths, json_rename, comparison_cache]


# -- the fuzz ----------------------------------------------------------------------------------------------------
def _judge(reader: str, level: str, outcome: str, value, expected: str, folder: Path, what: str) -> None:
    if outcome == "hang":
        pytest.fail(f"{what}: {reader} did not finish within {CASE_TIMEOUT} s (a hang)")
    if outcome == "raised":
        allowed = (QuantLensError, UsageError) if reader == "cli" else (QuantLensError,)
        if not isinstance(value, allowed):
            raise AssertionError(f"{what}: {reader} raised {type(value).__name__}, not a QuantLensError") from value
        assert str(folder) in str(value), f"{what}: {reader}'s error does not name the folder: {value}"
        return
    assert level != ERROR, f"{what}: {reader} read the damaged folder without a word"
    if level == STRICT:
        assert value == expected, f"{what}: {reader} gave a result other than the undamaged folder's"


@pytest.mark.parametrize("case", range(N_CASES))
def test_a_damaged_trace_folder_is_refused_or_read_as_it_was(traced, case):
    qa, root, pristine, expected = traced
    rng = random.Random(SEED * 1000 + case)
    folder = _fresh(root, f"case{case}", pristine)
    kind = KINDS[case % len(KINDS)]
    what, level = kind(rng, folder, rng.choice(SIDES))
    what = f"case {case} ({kind.__name__}): {what}"
    levels = level if isinstance(level, dict) else {"api": level, "cli": level}
    fifos = [p for p in folder.rglob("*") if p.is_fifo()]
    try:
        for reader, fn in READERS.items():
            outcome, value = _bounded(fn, qa, folder)
            known = levels[reader] if isinstance(levels[reader], dict) else {"level": levels[reader]}
            try:
                _judge(reader, known["level"], outcome, value, expected[reader], folder, what)
            except AssertionError:
                if "xfail" in known:  # a known bug outside the files this suite's fixes may touch
                    pytest.xfail(known["xfail"])
                raise
    finally:
        _release(fifos)


def test_a_per_channel_scale_list_is_refused_for_any_bad_element():
    """The per-channel scale check runs over whole lists at C speed; each element must still be a non-negative
    finite int or float (a bool, a string, None, a negative, NaN or Inf anywhere in the list is refused)."""
    from quantlens.profiler.trace.format import _scale

    good = [0.5] * 1000
    assert _scale(good) and _scale([0, 1, 2.5]) and _scale(None) and _scale(0.25)
    for bad in (True, "x", None, -1e-9, float("nan"), float("inf"), [0.1], {}):
        for at in (0, 500, 999):
            values = list(good)
            values[at] = bad
            assert not _scale(values), (bad, at)
    assert not _scale([]) and not _scale(-0.5) and not _scale(True)
