"""IR files under damage: a seeded fuzz of ``quantlens.compiler.load`` and the header checks it makes.

Every mutation of a saved file (byte flips, truncations, insertions, deletions, edits of the 8-byte length field,
of the safetensors header and of the quantlens JSON header) must either raise ``QuantLensError`` naming the file,
or load a module whose outputs equal the original's on a fixed input. Header edits are also *resealed* (the
checksum recomputed, as a careless tool that rewrites the file would): then load's header validation alone stands
between the edit and the model, and it may only refuse (``QuantLensError``) or load; no other exception escapes.

``pytest -s`` prints the counts per mutation kind.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
import time
from collections import Counter

import pytest
import torch
from torch.utils import _pytree as pytree

from quantlens.compiler import convert, export, load, save
from quantlens.compiler.serialize import CHECKSUM_KEY, FORMAT_VERSION, METADATA_KEY, file_checksum
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.zoo import example_inputs, get_model, sample_batches

SEED = 20240610
RAW_MUTATIONS = 6000  # per run, over both files (about 5 s)
RESEALED_MUTATIONS = 1000


# -- the files ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two small zoo IRs (multitask: const input leaves, two outputs), qat and quantized, saved once."""
    folder = tmp_path_factory.mktemp("fuzz_src")
    name = "multitask"
    example = example_inputs(name)
    model = prepare(get_model(name), example, check_result_dir=None)
    calibrate(model, sample_batches(name, 2, 4))
    qat = export(pre_export(model), example)
    files = {}
    for ir in (qat, convert(qat)):
        path = save(ir, folder / f"{name}_{ir.kind}.qlir")
        files[ir.kind] = (path.read_bytes(), _outputs(ir, example), example)
    return files


def _outputs(module, example) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(module(*example)) if isinstance(x, torch.Tensor)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():
            if not (torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(outer: dict, body: bytes) -> bytes:
    raw = json.dumps(outer, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _with_header(data: bytes, header: dict | str, reseal: bool, tensors: dict | None = None) -> bytes:
    outer, body = _split(data)
    text = header if isinstance(header, str) else json.dumps(header, ensure_ascii=False, separators=(",", ":"))
    outer["__metadata__"][METADATA_KEY] = text
    if reseal:
        outer["__metadata__"][CHECKSUM_KEY] = file_checksum(text, tensors)
    return _join(outer, body)


def _header_of(data: bytes) -> dict:
    return json.loads(_split(data)[0]["__metadata__"][METADATA_KEY])


# -- mutations -----------------------------------------------------------------------------------------------------
_TOKENS = [b" ", b"\n", b"0", b"9", b"-", b",", b":", b'"', b"\\", b"{", b"}", b"[", b"]", b"null", b"1e400",
           b'\\"', b"\x00", b"\xff", b"\xc3"]
_UNKNOWN_OPS = ["conv3d", "requantize_v2", "", "Conv2d", "fake_quant "]


def _raw_mutation(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    head_end = 8 + n

    def pos(header_bias=0.75):
        return rng.randrange(8, head_end) if rng.random() < header_bias else rng.randrange(0, len(data))

    kind = rng.choices(["flip", "flips", "truncate", "insert", "delete", "length", "outer"],
                       weights=[30, 10, 10, 15, 10, 8, 17])[0]
    b = bytearray(data)
    if kind == "flip":
        i = pos()
        b[i] ^= (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(1, 256)
    elif kind == "flips":
        for _ in range(rng.randint(2, 6)):
            b[pos(0.5)] ^= rng.randrange(1, 256)
    elif kind == "truncate":
        cut = rng.choice([rng.randrange(0, head_end), rng.randrange(head_end, len(data)), len(data) - 1])
        b = b[:cut]
    elif kind == "insert":
        i = pos()
        chunk = rng.choice(_TOKENS) if rng.random() < 0.6 else bytes(rng.randrange(256)
                                                                      for _ in range(rng.randint(1, 16)))
        b[i:i] = chunk
    elif kind == "delete":
        i = pos()
        del b[i:i + rng.randint(1, 16)]
    elif kind == "length":
        choice = rng.randrange(5)
        new = [n + rng.choice([-8, -1, 1, 7, 8, 64]), 0, rng.randrange(2**64), 2**64 - 1,
               len(data) - 8][choice]
        b[:8] = struct.pack("<Q", max(0, min(new, 2**64 - 1)))
    else:  # an edit of the safetensors header, re-serialised with a correct length
        return "outer", _outer_edit(rng, data)
    return kind, bytes(b)


def _outer_edit(rng: random.Random, data: bytes) -> bytes:
    outer, body = _split(data)
    names = [k for k in outer if k != "__metadata__"]
    meta = outer["__metadata__"]
    name = rng.choice(names)
    entry = outer[name]
    edit = rng.randrange(9)
    if edit == 0:
        entry["dtype"] = rng.choice(["F32", "I32", "F16", "BF16", "I8", "U8", "I64", "BOOL", "F64", "X9"])
    elif edit == 1 and entry["shape"]:
        i = rng.randrange(len(entry["shape"]))
        entry["shape"][i] += rng.choice([-1, 1, 2])
    elif edit == 2:
        entry["shape"] = list(reversed(entry["shape"])) + ([1] if rng.random() < 0.5 else [])
    elif edit == 3:
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-4, -1, 1, 4, 8])
    elif edit == 4:  # two tensors swap names
        other = rng.choice(names)
        outer[name], outer[other] = outer[other], outer[name]
    elif edit == 5:
        del outer[name]
    elif edit == 6:
        digest = meta[CHECKSUM_KEY]
        i = rng.randrange(len(digest))
        meta[CHECKSUM_KEY] = digest[:i] + rng.choice("0123456789abcdef".replace(digest[i], "")) + digest[i + 1:]
    elif edit == 7:
        rng.choice([lambda: meta.pop(CHECKSUM_KEY), lambda: meta.update(extra="1"),
                    lambda: meta.update({CHECKSUM_KEY: meta[CHECKSUM_KEY].upper()})])()
    else:  # the same header text, pretty-printed (whitespace only)
        meta[METADATA_KEY] = json.dumps(json.loads(meta[METADATA_KEY]), indent=rng.choice([None, 1]))
    return _join(outer, body)


def _paths(obj, prefix=()):
    """Every (container, key) position of a JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k
            yield from _paths(v)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i
            yield from _paths(v)


def _number_edit(rng: random.Random, v):
    if type(v) is bool:
        return not v
    if type(v) is int:
        return rng.choice([v + 1, v - 1, -v - 1, v * 2 + 1, 0, 2**31, 2**63, -1, v + 0.5, str(v), None])
    if type(v) is float:
        return rng.choice([v * 2, -v, v + 1e-7, 0.0, 1e308, int(v) if math.isfinite(v) else 0, str(v), None])
    return v


def _header_edit(rng: random.Random, header: dict) -> tuple[str, dict]:
    """A structural edit of the quantlens header: numbers, types, deleted or added keys, added ops ..."""
    h = copy.deepcopy(header)
    nodes = h["nodes"]
    kind = rng.choices(["number", "type", "delete", "add_key", "add_op", "node_order", "rename", "attr"],
                       weights=[25, 15, 12, 8, 12, 8, 8, 12])[0]
    spots = list(_paths(h))
    if kind == "number":
        numeric = [(c, k) for c, k in spots if type(c[k]) in (int, float, bool)]
        c, k = rng.choice(numeric)
        c[k] = _number_edit(rng, c[k])
    elif kind == "type":
        c, k = rng.choice(spots)
        c[k] = rng.choice([None, "x", 0, 1.5, True, [], {}, [c[k]], {"$tuple": [c[k]]}, {"$float": "nan"},
                           {"$dict": [[1, 2]]}, {"$x": 1}])
    elif kind == "delete":
        keyed = [(c, k) for c, k in spots if isinstance(c, dict)] + [(c, k) for c, k in spots if isinstance(c, list)]
        c, k = rng.choice(keyed)
        del c[k]
    elif kind == "add_key":
        c = rng.choice([h, rng.choice(nodes), rng.choice(h["values"]), rng.choice(nodes)["attrs"]])
        c[rng.choice(["extra", "op", "shift", "multiplier", "dim", "host", "out_dtype", "$tuple"])] = rng.choice(
            [1, -1, "qint4", [1, 2], None, True])
    elif kind == "add_op":
        node = copy.deepcopy(rng.choice(nodes))
        node["op"] = rng.choice(list(IR_OPS) + _UNKNOWN_OPS)
        if rng.random() < 0.5:
            node["outputs"] = [f"{o}_fuzz" for o in node["outputs"]]
        nodes.insert(rng.randrange(len(nodes) + 1), node)
    elif kind == "node_order":
        i, j = rng.randrange(len(nodes)), rng.randrange(len(nodes))
        if rng.random() < 0.5:
            nodes[i], nodes[j] = nodes[j], nodes[i]
        else:
            nodes[i] = copy.deepcopy(nodes[j])
    elif kind == "rename":
        names = [(c, k) for c, k in spots if isinstance(c[k], str) and c[k]]
        c, k = rng.choice(names)
        c[k] = rng.choice([c[k] + "_", c[k][:-1], "", "x", rng.choice(h["constants"]), rng.choice(h["inputs"])])
    else:  # the attrs that carry integer arithmetic
        with_attrs = [n for n in nodes if n["attrs"]]
        node = rng.choice(with_attrs)
        key = rng.choice(sorted(node["attrs"]))
        v = node["attrs"][key]
        if isinstance(v, list) and v and rng.random() < 0.7:
            i = rng.randrange(len(v))
            v[i] = _number_edit(rng, v[i])
            if rng.random() < 0.2:
                v.pop()
        else:
            node["attrs"][key] = _number_edit(rng, v) if type(v) in (int, float, bool) else rng.choice(
                ["qint4", "int8", 3, [], None, -1])
    return kind, h


# -- the fuzz ------------------------------------------------------------------------------------------------------
def _classify(path, data, want, example, original) -> str:
    if data == original:  # e.g. a header edit that re-serialises to the same text
        return "unchanged bytes"
    path.write_bytes(data)
    try:
        module = load(path)
    except QuantLensError as exc:
        return "refused" if str(path) in str(exc) else "refused without the file name"
    except Exception as exc:  # noqa: BLE001 - what the fuzz looks for
        return f"other exception ({type(exc).__name__})"
    try:
        got = _outputs(module, example)
    except Exception:  # noqa: BLE001
        return "loaded but different"
    return "loaded, same outputs" if _same(want, got) else "loaded but different"


def test_fuzz_damaged_files_are_refused_or_load_the_same_model(saved, tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "mutated.qlir"
    start = time.perf_counter()
    counts: Counter = Counter()
    by_kind: dict[str, Counter] = {}
    examples: dict[str, str] = {}
    originals = list(saved.items())
    for i in range(RAW_MUTATIONS):
        ir_kind, (data, want, example) = originals[i % len(originals)]
        if rng.random() < 0.2:  # a header edit kept with the original checksum
            kind, header = _header_edit(rng, _header_of(data))
            kind, mutated = f"header:{kind}", _with_header(data, header, reseal=False)
        else:
            kind, mutated = _raw_mutation(rng, data)
        outcome = _classify(path, mutated, want, example, data)
        counts[outcome] += 1
        by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome not in ("refused", "unchanged bytes"):
            examples.setdefault(outcome, f"{ir_kind} {kind} #{i}")
    elapsed = time.perf_counter() - start
    print(f"\nIR file fuzz: {RAW_MUTATIONS} mutations in {elapsed:.1f} s: {dict(counts)}")
    for kind in sorted(by_kind):
        print(f"  {kind:20s} {dict(by_kind[kind])}")
    assert sum(counts.values()) == RAW_MUTATIONS >= 2000
    assert counts["loaded but different"] == 0, examples
    assert not [k for k in counts if k.startswith("other exception") or k.endswith("file name")], examples
    # Nearly every change is caught by the checksum; a changed file may load only if it is the same model (e.g.
    # other whitespace in the safetensors header's padding), which this seed does not produce.
    assert counts["refused"] >= 0.95 * RAW_MUTATIONS


def test_fuzz_resealed_header_edits_are_refused_or_load(saved, tmp_path):
    """With the checksum recomputed, the header checks must refuse what would break a run or name undefined
    values; an edit they accept is a valid model (e.g. another multiplier), so only the exception type counts."""
    from safetensors.torch import load as load_tensors

    rng = random.Random(SEED + 1)
    path = tmp_path / "resealed.qlir"
    start = time.perf_counter()
    counts: Counter = Counter()
    runs: Counter = Counter()
    examples: dict[str, str] = {}
    originals = [(kind, data, want, example, load_tensors(data)) for kind, (data, want, example) in saved.items()]
    for i in range(RESEALED_MUTATIONS):
        ir_kind, data, want, example, tensors = originals[i % len(originals)]
        kind, header = _header_edit(rng, _header_of(data))
        path.write_bytes(_with_header(data, header, reseal=True, tensors=tensors))
        try:
            module = load(path)
        except QuantLensError as exc:
            outcome = "refused" if str(path) in str(exc) else "refused without the file name"
        except Exception as exc:  # noqa: BLE001
            outcome = f"other exception ({type(exc).__name__}: {exc})"
        else:
            outcome = "loaded"
            try:
                runs["same outputs" if _same(want, _outputs(module, example)) else "other outputs"] += 1
            except QuantLensError:
                runs["run refused (QuantLensError)"] += 1
            except Exception as exc:  # noqa: BLE001 - informational: a valid header need not describe a runnable model
                runs[f"run failed ({type(exc).__name__})"] += 1
        counts[outcome.split(":")[0] if outcome.startswith("other") else outcome] += 1
        if outcome != "refused" and outcome != "loaded":
            examples.setdefault(outcome, f"{ir_kind} {kind} #{i}")
    print(f"\nresealed header edits: {RESEALED_MUTATIONS} in {time.perf_counter() - start:.1f} s: {dict(counts)}; "
          f"runs of those loaded: {dict(runs)}")
    assert not [k for k in counts if k not in ("refused", "loaded")], examples
    assert counts["refused"] >= 0.5 * RESEALED_MUTATIONS


# -- targeted header checks (resealed edits) -------------------------------------------------------------------------
def _resealed(saved, tmp_path, ir_kind, edit) -> str:
    from safetensors.torch import load as load_tensors

    data = saved[ir_kind][0]
    header = _header_of(data)
    edit(header)
    path = tmp_path / "edited.qlir"
    path.write_bytes(_with_header(data, header, reseal=True, tensors=load_tensors(data)))
    with pytest.raises(QuantLensError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message
    return message


def _node(header, op=None, attr=None):
    return next(n for n in header["nodes"] if (op is None or n["op"] == op) and (attr is None or attr in n["attrs"]))


@pytest.mark.parametrize("case, ir_kind, edit, expected", [
    ("unknown op", "qat", lambda h: _node(h).update(op="conv3d"), "not an IR op"),
    ("quantized op in a qat IR", "qat", lambda h: _node(h, "relu").update(op="requantize"), "quantized-level op"),
    ("qat op in a quantized IR", "quantized", lambda h: _node(h, "conv2d").update(op="fake_quant"),
     "qat-level op"),
    ("negative shift", "quantized", lambda h: _node(h, attr="shift")["attrs"]["shift"].__setitem__(0, -1),
     "attr 'shift'"),
    ("float multiplier", "quantized", lambda h: _node(h, attr="multiplier")["attrs"].update(multiplier=[0.5]),
     "attr 'multiplier'"),
    ("multiplier out of int32", "quantized",
     lambda h: _node(h, attr="multiplier")["attrs"]["multiplier"].__setitem__(0, 2**31), "attr 'multiplier'"),
    ("one shift per multiplier", "quantized",
     lambda h: _node(h, attr="multipliers")["attrs"]["shifts"].pop(), "one shift per multiplier"),
    ("unknown out_dtype", "quantized", lambda h: _node(h, attr="out_dtype")["attrs"].update(out_dtype="qint4"),
     "attr 'out_dtype'"),
    ("dilation not ints", "qat", lambda h: _node(h, "conv2d")["attrs"].update(dilation=["1", 1]),
     "attr 'dilation'"),
    ("reshape shape below -1", "qat", lambda h: _node(h, "reshape")["attrs"]["shape"].__setitem__(0, -2),
     "attr 'shape'"),
    ("stride a string", "qat", lambda h: _node(h, "conv2d")["attrs"].update(stride="1"), "attr 'stride'"),
    ("bool as int", "qat", lambda h: _node(h, attr="qmin")["attrs"].update(qmin=True), "attr 'qmin'"),
    ("qmin above qmax", "qat", lambda h: _node(h, attr="qmin")["attrs"].update(qmin=200), "exceeds 'qmax'"),
    ("shape of strings", "qat", lambda h: h["values"][0].update(shape=["1"]), "shape"),
    ("unknown dtype", "qat", lambda h: h["values"][0].update(dtype="float33"), "dtype"),
    ("unknown qdtype", "quantized", lambda h: h["values"][-1].update(qdtype="qint4"), "qdtype"),
    ("scale not a constant", "quantized",
     lambda h: next(v for v in h["values"] if v["scale"]).update(scale="nowhere"), "scale"),
    ("constant info differs", "qat",
     lambda h: next(v for v in h["values"] if v["name"] == h["constants"][0]).update(dtype="int8"),
     "differ from the constant"),
    ("undefined input", "qat", lambda h: _node(h)["inputs"].__setitem__(0, "nowhere"), "undefined value"),
    ("use before definition", "qat", lambda h: h["nodes"].reverse(), "undefined value"),
    ("cycle: a node writes its input", "qat",
     lambda h: _node(h, "relu").update(outputs=list(_node(h, "relu")["inputs"][:1])), "already defined"),
    ("two nodes write one value", "qat", lambda h: h["nodes"][1].update(outputs=h["nodes"][0]["outputs"]),
     "already defined"),
    ("missing output", "qat", lambda h: h["outputs"].append("nowhere"), "never computed"),
    ("missing field", "qat", lambda h: h.pop("values"), "lacks the fields ['values']"),
    ("unknown node field", "qat", lambda h: _node(h).update(weight=1), "unknown fields"),
    ("unknown kind", "qat", lambda h: h.update(kind="float"), "kind"),
    ("leaf count vs spec", "qat", lambda h: h["input_leaves"].pop(), "input"),
    ("broken spec", "qat", lambda h: h.update(output_spec="[1"), "output_spec"),
    ("bad $float", "qat", lambda h: h["meta"].update(x={"$float": "NaN"}), "meta"),
    ("deep nesting", "qat", lambda h: h["meta"].update(x=json.loads("[" * 200 + "]" * 200)), "nested"),
    ("constants list", "qat", lambda h: h["constants"].append("ghost"), "do not match"),
])
def test_header_checks(saved, tmp_path, case, ir_kind, edit, expected):
    assert expected in _resealed(saved, tmp_path, ir_kind, edit), case


# -- file kinds and versions ---------------------------------------------------------------------------------------
def test_fifo_and_devices_are_refused_without_blocking(tmp_path):
    import threading

    fifo = tmp_path / "pipe.qlir"
    os.mkfifo(fifo)
    result = {}

    def attempt():
        try:
            load(fifo)
        except QuantLensError as exc:
            result["message"] = str(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "load blocked on a FIFO"
    assert "named pipe" in result["message"] and str(fifo) in result["message"]
    for device in ("/dev/zero", "/dev/null"):
        if os.path.exists(device):
            with pytest.raises(QuantLensError, match="character device"):
                load(device)


def test_symlink_to_a_file_loads(saved, tmp_path):
    target = tmp_path / "real.qlir"
    target.write_bytes(saved["qat"][0])
    link = tmp_path / "link.qlir"
    link.symlink_to(target)
    assert load(link).kind == "qat"


def test_older_and_newer_format_versions(saved, tmp_path):
    data = saved["qat"][0]
    for version, words in ((1, "older quantlens"), (FORMAT_VERSION + 1, "Upgrade quantlens")):
        header = _header_of(data)
        header["format_version"] = version
        path = tmp_path / f"v{version}.qlir"
        path.write_bytes(_with_header(data, header, reseal=False))
        with pytest.raises(QuantLensError) as info:
            load(path)
        assert words in str(info.value) and f"version {version}" in str(info.value) and str(path) in str(info.value)


def test_checksum_covers_the_header(saved, tmp_path):
    """A requantize multiplier changed by one (a valid value) fails the checksum."""
    data = saved["quantized"][0]
    header = _header_of(data)
    node = _node(header, attr="multiplier")
    node["attrs"]["multiplier"][0] += 1
    path = tmp_path / "edited.qlir"
    path.write_bytes(_with_header(data, header, reseal=False))
    with pytest.raises(QuantLensError, match="checksum"):
        load(path)
