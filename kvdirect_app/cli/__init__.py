"""The benchmark commands of `python -m kvdirect_app.bench`: run, sweep, breakeven, replay, capacity.

Each prints a readable table and can write JSON; bad input exits with
status 2 and one line naming the setting and its allowed values.
"""

from __future__ import annotations

import argparse
import sys

from ..models import ModelError
from ..prompts import InputError
from ..strategies import StrategyError
from . import anchor, run, sweep
from .common import CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvdirect_app.bench",
                                     description="KV-Direct Studio benchmarks: tables and JSON")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (run, sweep, anchor):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ModelError, StrategyError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
