"""The benchmark commands of `python -m kvdirect_app.bench`: run, sweep, breakeven, replay, capacity, roofline...

Each prints a readable table and can write JSON; bad input exits with
status 2 and one line naming the setting and its allowed values.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..plain.errors import UserError
from . import anchor, check, doc_figures, record, reproduce, roofline, run, sweep, tasks


class Parser(argparse.ArgumentParser):
    """argparse's errors as one line (the option, what is wrong) and status 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m kvdirect_app.bench", description="KV-Direct Studio benchmarks: tables and JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (run, record, sweep, anchor, reproduce, tasks, roofline, check, doc_figures):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's own exit (a bad option, --help): its status, its line already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError) as e:
        print(
            f"error: out of memory during the run ({type(e).__name__}); the memory guard's estimate fell short: "
            "try fewer tokens or strategies",
            file=sys.stderr,
        )
        return 3
