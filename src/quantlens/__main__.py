"""``python -m quantlens``: the command line (``quantlens --help``)."""

from quantlens.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
