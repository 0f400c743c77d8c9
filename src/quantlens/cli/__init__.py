"""The ``quantlens`` command line: ``quantlens analyze | report | inspect | sensitivity | compare | fix``.

Each command is one small module of this package with ``add_parser(subparsers)`` and ``run(args) -> int``.
Exit codes: 0 ok, 1 the analysis found problems (advisor findings, a diverged op), 2 usage or bad input, or a
stage that failed (``analyze`` reports the pairs built before it).
Errors print their message without a traceback; ``--debug`` shows it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from quantlens._advice import speaking_to
from quantlens.cli.exits import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, UsageError

__all__ = ["main", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "UsageError", "warning_origin"]


def quiet_torch() -> None:
    # torch.export deep-copies pytree specs, which trips torch's own deprecation shim (not ours to fix here)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors exit 2 as well, with the usage line
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from quantlens import __version__
    from quantlens.cli import analyze, compare, fix, inspect_ir, report, sensitivity

    parser = _Parser(prog="quantlens", description="PyTorch to integer NPU (int8/int16): run the stages, find "
                     "where precision is lost, inspect deployed IR files.",
                     epilog="Exit codes: 0 ok, 1 the analysis found problems, 2 usage or bad input, or a stage that failed. "
                     "Run 'quantlens COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"quantlens {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in (analyze, report, inspect_ir, sensitivity, compare, fix):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = args.debug or getattr(args, "sub_debug", False)
    # Piped or redirected (not a terminal), an error is written unwrapped: rich would otherwise fold it at 80
    # columns, splitting the paths and the suggested commands that users copy from it.
    err = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())
    quiet_torch()
    with warnings.catch_warnings(), speaking_to("config"):  # advice names what a CONFIG user changes
        if not debug:  # a warning is one line in words, not Python's "file:line: UserWarning" and a source line
            warnings.showwarning = lambda message, category, filename, lineno, *rest: err.print(
                f"[yellow]{warning_origin(category, filename, lineno)}[/] {escape(str(message))}")
        return _run(args, err, debug)


def warning_origin(category: type, filename: str, lineno: int) -> str:
    """``warning:`` for quantlens' own warnings (:class:`~quantlens.errors.QuantLensWarning`); another warning names
    the package of the code it points at and the line (torch's warning about a GRU's weights during export is
    torch's, not a finding of quantlens)."""
    from quantlens.errors import QuantLensWarning

    if issubclass(category, QuantLensWarning):
        return "warning:"
    path = Path(filename)
    parts = path.parts
    package = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] in ("site-packages", "dist-packages")),
                   path.name)
    return f"warning from {package.removesuffix('.py')} ({path.name}:{lineno}):"


def _run(args, err, debug: bool) -> int:
    from rich.markup import escape

    from quantlens.errors import QuantLensError

    try:
        return int(args.func(args) or 0)
    except (UsageError, QuantLensError) as exc:
        if debug:
            err.print_exception()
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug or an environment problem: no traceback unless asked
        if debug:
            err.print_exception()
        else:
            err.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}\n"
                      "(an unexpected error: run with --debug for the traceback)")
        return EXIT_USAGE
