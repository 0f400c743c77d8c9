"""The profiler's files and bad cases fail in words (issue #43): a read-only or full out_dir before any work, a
folder where a file belongs, a damaged badcase.pt, a bad case of the wrong width; and run() holds a bounded
amount of memory beyond the forward however many op sites the model has (docs/guarantees.md)."""

from __future__ import annotations

import os
import time
from collections import namedtuple

import pytest
import torch
from torch import nn

import quantlens._io as qio
from quantlens.errors import DiskFullError, NotWritableError, QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.trace import _pool, writer
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from tests.test_cli import ql
from tests.test_user_data_and_files import _Net  # a two-linear net taking (N, 8)


def _pair(out_dir, model=None, x=None):
    torch.manual_seed(0)
    model = model if model is not None else _Net().eval()
    x = x if x is not None else torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    prepared = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    calibrate(prepared, [(x,)])
    return QuantAnalysis(model, prepared, "fake_quant", out_dir, progress=False), x


def _no_raw_errno(text: str) -> None:
    assert "[Errno" not in text and "OSError" not in text, text


def _forwards(model) -> list:
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_a_full_disk_is_said_before_the_search_and_the_run(tmp_path, monkeypatch):
    model = _Net().eval()
    qa, x = _pair(tmp_path / "out", model)
    calls = _forwards(model)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(qio.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    for call in (lambda: qa.auto_find_bad_case([(x,)] * 3), lambda: qa.set_bad_case((x,))):
        with pytest.raises(DiskFullError, match="no space left to write into .*out.*0 bytes free") as info:
            call()
        _no_raw_errno(str(info.value))
    assert not calls  # no model ran: the search would have been lost
    qa._bad_case, qa._has_bad_case = (x,), True
    with pytest.raises(DiskFullError, match=r"run\(\): no space left"):
        qa.run()
    assert not calls and not (tmp_path / "out").exists()


def test_a_folder_where_a_file_belongs_is_said_and_nothing_half_written(tmp_path):
    qa, x = _pair(tmp_path)
    (tmp_path / "badcase.pt").mkdir()
    with pytest.raises(NotWritableError, match="badcase.pt in .*is a folder where a file belongs") as info:
        qa.set_bad_case((x,))
    _no_raw_errno(str(info.value))
    assert isinstance(info.value, QuantLensError)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_read_only_folder_written_to_is_said(tmp_path, monkeypatch):
    """A folder that turns read-only between the checks and the write (a remount) fails in words too."""
    import errno

    qa, x = _pair(tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))

    monkeypatch.setattr(qio.tempfile, "mkstemp", read_only)
    with pytest.raises(NotWritableError, match="badcase.pt in .* is on a read-only disk") as info:
        qa.set_bad_case((x,))
    _no_raw_errno(str(info.value))


def test_report_into_a_read_only_folder_is_refused_before_rendering(tmp_path, monkeypatch):
    qa, x = _pair(tmp_path)
    qa.set_bad_case((x,))
    qa.run()
    qa.compare_per_layer()
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    real_access = os.access
    monkeypatch.setattr(qio.os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    monkeypatch.setattr(qio, "_read_only", lambda p: str(p) == str(tmp_path), raising=False)
    done = ql("report", tmp_path, "--type", "fake_quant")
    err = done.stderr
    assert done.returncode == 2
    assert f"{tmp_path} is on a read-only disk" in err and "copy OUT_DIR to a writable place" in err
    _no_raw_errno(err)
    assert "unexpected error" not in err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_damaged_bad_case_file_is_named_with_the_fix(tmp_path):
    qa, x = _pair(tmp_path)
    qa.set_bad_case((x,))
    path = tmp_path / "badcase.pt"
    data = path.read_bytes()
    for damaged in (data[: len(data) // 2], b""):
        path.write_bytes(damaged)
        with pytest.raises(QuantLensError) as info:
            qa.load_bad_case()
        text = str(info.value)
        assert str(path) in text and "is damaged" in text and "set_bad_case" in text and "auto_find_bad_case" in text
        assert "PytorchStreamReader" not in text and "\n" not in text


def test_a_bad_case_of_the_wrong_width_names_the_input_and_the_shapes(tmp_path):
    qa, x = _pair(tmp_path)
    wide = (torch.randn(4, 9),)
    with pytest.raises(QuantLensError, match=r"input\[0\] has shape \(4, 9\).*fc1 takes 8.*\(4, 8\)") as info:
        qa.set_bad_case(wide)
    assert "mat1" not in str(info.value)
    with pytest.raises(QuantLensError, match=r"sample 1 of data_generator's input\[0\] has shape \(4, 9\)"):
        qa.auto_find_bad_case([(x,), wide])
    qa.set_bad_case((x,))
    torch.save(wide, tmp_path / "badcase.pt")  # (a bad case saved by hand, loaded back)
    qa.load_bad_case()
    with pytest.raises(QuantLensError, match=r"run\(\): the bad case's input\[0\] has shape \(4, 9\)"):
        qa.run()
    qa.set_bad_case((torch.randn(2, 8),))  # another batch size is no problem
    qa.run()


class _Deep(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def test_run_holds_a_few_sites_of_copies_however_many_sites_there_are(tmp_path, monkeypatch):
    """A writer slower than the forward (here: each file takes 2 ms more) lets copies pile up; the queue's
    budget follows the sites' size, so what waits stays a few sites' worth, not the network's
    (benchmarks/bench_run_many_sites.py measures the whole run)."""
    model = _Deep(24, 128).eval()  # 72 op sites of 64 KiB activations
    qa, x = _pair(tmp_path, model, torch.randn(128, 128))
    qa.set_bad_case((x,))
    write = writer.write_safetensors
    monkeypatch.setattr(writer, "write_safetensors", lambda *a: (time.sleep(0.002), write(*a)))
    peaks, take = [], _pool.BufferPool.take

    def counting_take(self, nbytes, *args, **kwargs):
        buf = take(self, nbytes, *args, **kwargs)
        peaks.append((self.out, nbytes))
        return buf

    monkeypatch.setattr(_pool.BufferPool, "take", counting_take)
    result = qa.run()
    assert result.analysis_sites == 72
    largest = max(n for _, n in peaks)
    held = max(out for out, _ in peaks)
    assert held <= max(writer.QUEUE_FLOOR, writer.QUEUE_SITES * largest) + largest, (held, largest)
