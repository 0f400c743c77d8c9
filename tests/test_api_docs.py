"""The API reference (docs/api.md) builds from the docstrings without a warning and documents every public name."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("pdoc")

MODULES = ["quantlens", "quantlens.march", "quantlens.quantization", "quantlens.compiler", "quantlens.profiler",
           "quantlens.search"]


def test_api_reference_builds_without_warnings_and_lists_all(tmp_path):
    # The same command as docs/api.md, with every warning (pdoc reports docstring, annotation and import
    # problems as warnings) turned into an error.
    cmd = [sys.executable, "-W", "error", "-m", "pdoc", "--docformat", "restructuredtext",
           "-o", str(tmp_path), *MODULES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    for name in MODULES:
        page = tmp_path.joinpath(*name.split(".")).with_suffix(".html")
        assert page.is_file(), f"no page for {name}"
        html = page.read_text(encoding="utf-8")
        ids = set(re.findall(r'\bid="([^"]+)"', html))
        missing = [n for n in importlib.import_module(name).__all__ if n not in ids]
        assert not missing, f"{name}: names of __all__ not in the reference: {missing}"
