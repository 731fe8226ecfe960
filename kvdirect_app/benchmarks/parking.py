"""Parked sessions, measured for `bench capacity` (`api.capacity`): the strategies it compares
(`capacity_strategies`), and sessions of one of them parked in this process, their bytes measured, one resumed and
timed with its next turn's first token (`park`)."""

from __future__ import annotations

import psutil

from ..engine.runner import Engine
from ..models.prompts import filler_ids
from ..strategies import parse_spec


def capacity_strategies(geom, spacings: list[int], budget: int):
    """Each strategy with the settings it runs with (its default rebuild mode), plus AnchorKV's deepest
    spacing with ``rebuild=step``."""
    specs = ["full", f"kvdirect:budget={budget}"]
    specs += [f"anchorkv:spacing={s}:budget={budget}" for s in spacings]
    specs.append(f"anchorkv:spacing={geom.num_layers}:budget={budget}:rebuild=step")
    if any(layer.is_sliding for layer in geom.layers):
        specs += [f"anchorkv:spacing={s}:anchors=dp:budget={budget}" for s in spacings if s > 1]
    return [(spec, parse_spec(spec)) for spec in specs]


def _session(loaded, strategy, n: int, threads: int | None):
    """One session of `strategy` alone (no reference lane), `n` tokens of context, parked."""
    engine = Engine(
        loaded, [strategy], max_new_tokens=1, raw=True, threads=threads, compare=False, memory="trace"
    )  # parked bytes and resume peaks: the allocator's (the claims report reads them)
    for _ in engine.turn("context", ids=filler_ids(loaded.tokenizer, n)):
        pass
    engine.park()
    return engine


def park(loaded, strategy, n: int, sessions: int, threads: int | None) -> dict:
    """Park `sessions` sessions (at least one) in this process; bytes measured per session, then resume one
    and time it and its next turn's first token."""
    process = psutil.Process()
    before = process.memory_info().rss
    parked = [_session(loaded, strategy, n, threads) for _ in range(max(1, sessions))]
    after = process.memory_info().rss
    measured = [engine.reference.parks[-1]["bytes"] for engine in parked]
    engine = parked[0]
    resume = engine.resume()["lanes"][strategy.label]
    result = None
    for event in engine.turn(" Continue."):
        if event["type"] == "step":
            result = event["lanes"][strategy.label]
            break
    return {
        "sessions_parked": len(parked),
        "parked_bytes_measured": sum(measured) / len(measured),
        "rss_growth_per_session": (after - before) / len(parked),
        "resume_ms": resume["resume_ms"],
        "resume_peak_bytes": resume["resume_peak_bytes"],
        "next_ttft_ms": None if result is None else result["prefill_ms"],
        "kernels": engine.kernels.report(),
    }
