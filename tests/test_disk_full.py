"""A full disk is an error in words that keeps what was computed; a dangling out_dir link is refused in words
(issue #26 point 5, docs/guarantees.md)."""

from __future__ import annotations

import errno
import os
from collections import namedtuple

import pytest
import torch

import quantlens._io as qio
from quantlens import DiskFullError, QuantLensError
from quantlens._io import atomic_write_text
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.report import save_pt
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from tests.test_user_data_and_files import _Net  # a two-linear net


def _analysis(out_dir):
    torch.manual_seed(0)
    model = _Net().eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g),) for _ in range(3)]
    prepared = prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)
    calibrate(prepared, batches)
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir)
    qa.set_bad_case(batches[0])
    qa.run()
    return qa


def _leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


@pytest.fixture
def disk_full(monkeypatch):
    """Every write of the helper runs out of space when it renames its temporary file into place (as a write
    that hits ENOSPC at its last block would), on a disk reported with 4096 bytes free."""

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    def arm():
        monkeypatch.setattr(qio.os, "replace", no_space)
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(qio.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))

    return arm


def test_a_text_file_on_a_full_disk_names_the_folder_and_the_bytes(tmp_path, disk_full):
    disk_full()
    with pytest.raises(DiskFullError) as info:
        atomic_write_text(tmp_path / "report.txt", "x" * 10_000)
    err = info.value
    assert isinstance(err, QuantLensError)
    text = str(err)
    assert str(tmp_path) in text and "report.txt" in text and "10000 bytes needed" in text and "4096 bytes free" in text
    assert "another disk" in text
    assert err.needed == 10_000 and err.free == 4096 and err.folder == str(tmp_path)
    assert not (tmp_path / "report.txt").exists() and not _leftovers(tmp_path)


def test_torchs_unexpected_pos_on_a_full_disk_is_named_too(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as ``RuntimeError: ... unexpected pos 704 vs 598`` (what
    set_bad_case used to show): with (almost) no space free it is a DiskFullError."""
    def broken_save(obj, handle):
        handle.write(b"PK" * 300)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", broken_save)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(qio.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with pytest.raises(DiskFullError, match="no space left to write badcase.pt") as info:
        save_pt({"x": torch.zeros(3)}, tmp_path / "badcase.pt")
    assert "600 bytes needed" in str(info.value) and not _leftovers(tmp_path)
    # with space free the same RuntimeError is not a disk problem: it propagates as it is
    monkeypatch.setattr(qio.shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        save_pt({"x": torch.zeros(3)}, tmp_path / "badcase.pt")


def test_compare_and_sensitivity_keep_what_they_computed(tmp_path, disk_full):
    qa = _analysis(tmp_path / "ok")
    table = qa.compare_per_layer()
    sens = qa.sensitivity()
    full = _analysis(tmp_path / "full")
    disk_full()
    with pytest.raises(DiskFullError) as info:
        full.compare_per_layer()
    kept = info.value.result
    assert [r.op_name for r in kept] == [r.op_name for r in table]
    assert [r.Cosine for r in kept] == [r.Cosine for r in table]
    with pytest.raises(DiskFullError) as info:
        full.sensitivity()
    kept = info.value.result
    assert [(r.op_name, r.value) for r in kept[0]] == [(r.op_name, r.value) for r in sens[0]]
    assert not _leftovers(tmp_path / "full")


def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch):
    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(qio.os, "replace", denied)
    with pytest.raises(PermissionError):
        atomic_write_text(tmp_path / "a.txt", "x")
    assert not _leftovers(tmp_path)


def test_a_dangling_link_as_out_dir_is_refused_in_words(tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "missing" / "folder")
    model = _Net().eval()
    x = torch.randn(2, 8)
    prepared = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    calibrate(prepared, [(x,)])
    with pytest.raises(QuantLensError, match="dangling link") as info:
        QuantAnalysis(model, prepared, "fake_quant", link)
    assert str(tmp_path / "missing" / "folder") in str(info.value)
    assert link.is_symlink() and not (tmp_path / "missing").exists()  # nothing created, nothing removed
