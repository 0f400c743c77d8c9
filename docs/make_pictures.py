"""Regenerate the report pictures of docs/guide.md (docs/images/*.png).

Runs the demo (``python -m quantlens.demo``) into a temporary folder and screenshots its HTML pages with headless
Chromium (1200x900, the top of each page)::

    .venv/bin/python docs/make_pictures.py            # from the repository root, after ./dev demo or ./dev test
    .venv/bin/python docs/make_pictures.py --chromium /path/to/chromium

Takes about a minute on two cores. The pictures are only as current as the last run: rerun it when a report's
layout changes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
IMAGES = DOCS / "images"

#: picture name -> the demo page it shows (relative to the demo's output folder)
PAGES = {
    "demo_index.png": "index.html",
    "fake_quant_profiler.png": "fake_quant/profiler.html",
    "convert_profiler.png": "convert/profiler.html",
}


def screenshot(chromium: str, page: Path, png: Path) -> None:
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--virtual-time-budget=3000",  # let the page's scripts draw the charts
        f"--screenshot={png}", "--window-size=1200,900", page.resolve().as_uri(),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    if not png.is_file() or png.stat().st_size == 0:
        raise SystemExit(f"make_pictures: chromium wrote no screenshot of {page}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="headless Chromium binary")
    parser.add_argument("--out", default=str(IMAGES), help="folder for the pictures (default: docs/images)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quantlens_pictures_") as tmp:
        demo = Path(tmp) / "demo"
        env = dict(os.environ, COLUMNS="120")
        subprocess.run([sys.executable, "-m", "quantlens.demo", "--out", str(demo)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        for name, page in PAGES.items():
            screenshot(args.chromium, demo / page, out / name)
            print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
