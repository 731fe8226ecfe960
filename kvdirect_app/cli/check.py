"""`bench check-strategy SPEC`: the contract a strategy of one's own is held to
(`kvdirect_app/benchmarks/conformance.py`).

    python -m kvdirect_app.bench check-strategy examples/random_eviction.py:RandomEviction
    python -m kvdirect_app.bench check-strategy mypackage.strategies:ValueNorm:budget=32 --models tiny-llama

A line per rule and model as soon as it is judged, ``ok`` or ``FAIL`` with what broke and where (never a traceback:
whatever the strategy raises is one FAIL line); the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse

from ..benchmarks import conformance
from .common import CliError


def cmd_check(args) -> int:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        raise CliError("--models: none given; allowed: comma-separated presets, e.g. " + ",".join(conformance.MODELS))
    findings = conformance.check(args.spec, models, say=lambda finding: print(finding.line(), flush=True))
    failed = [f for f in findings if not f.ok]
    print(
        f"\n{args.spec}: {len(findings) - len(failed)} of {len(findings)} checks passed"
        + (f"; {len(failed)} failed" if failed else "")
    )
    return 1 if failed else 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check-strategy",
        help="the contract a strategy of one's own is held to (shape, "
        "scores, budget, time, determinism, masks, sliding layers, bytes, "
        "nothing hidden, exactness)",
    )
    p.add_argument(
        "spec",
        help="a spec: name[:k=v...], PATH.py:Class[:k=v...] or module:Class[:k=v...] (without a "
        "budget, one that makes it evict on each model is set)",
    )
    p.add_argument(
        "--models",
        default=",".join(conformance.MODELS),
        help=f"comma-separated presets (default {','.join(conformance.MODELS)})",
    )
    p.set_defaults(func=cmd_check)
    return p
