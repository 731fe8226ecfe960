"""Building the engine's lanes before its first step: the reference and every strategy's lane, each strategy made
again and its cache built inside the lane's own region of the observer, and the region an owner's work outside a
pass runs in (`work_region`, the `Work` that building, forking, ending a turn, parking and resuming are given).

Plain functions, each given what it reads; `Engine.__init__` (`runner.py`) calls them and keeps what they make.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..kernels.invariant import Kernels
from ..measure.memory import AllocationTracer
from ..measure.observe import Observer, Owner, instrument, storage_sizes, watch
from ..models.prompts import InputError
from ..strategies import Strategy
from ..strategies.full import Full
from .between_turns import Work
from .lanes import ByteBook, Lane, made_again


@contextlib.contextmanager
def work_region(observer: Observer, tracer: AllocationTracer, owner: Owner, op: str):
    """`owner`'s work outside a pass (building, forking, ending a turn, parking, resuming): a region of the
    observer, traced in a session of its own with ``--memory trace`` (the session's start and fold are the
    trace's work)."""
    if tracer.enabled:
        with observer.region(instrument("trace"), "session"):
            tracer.start(owner.label)
    try:
        with observer.region(owner, op):
            yield
    finally:
        if tracer.enabled:
            with observer.region(instrument("trace"), "session"):
                tracer.stop()


def build_lane(
    strategy: Strategy,
    model: torch.nn.Module,
    device: torch.device,
    observer: Observer,
    work: Work,
    kernels: Kernels,
    memory: str,
    peak_source: str | None,
) -> Lane:
    """The strategy's lane: the strategy made again from its settings inside the lane's own region, then its
    cache, so that whatever it allocates when it is made (in `__post_init__`) is the lane's, never a baseline."""
    lane = Lane(strategy, None, strategy.label, ByteBook(measured=memory != "none", peak_source=peak_source))
    observer.register(lane.owner)
    with work(lane.owner, "build"):
        lane.strategy = made_again(strategy)
        lane.cache = watch(lane.strategy.build_cache(model))
    lane.cache.model = model  # what its twins share (`StrategyCache.fork`)
    lane.cache.use_kernels(kernels)
    if device.type == "cuda" and memory in ("allocator", "trace"):
        # The caching allocator rounds blocks: measured and formula compared like for like.
        lane.book.held_sizes = lambda: list(storage_sizes(*lane.cache.state_tensors()).values())
    return lane


def build_lanes(
    strategies: list[Strategy], solo: bool, make: Callable[[Strategy], Lane]
) -> tuple[Lane, list[Lane], list[str]]:
    """(the reference's lane, the compared lanes, the labels shown in the order given), each lane made by `make`.
    `solo`: one strategy as deployed alone drives the conversation, nothing is compared (no reference is built)."""
    if solo:
        if len(strategies) != 1:
            raise InputError(f"--solo: runs exactly one strategy, got {len(strategies)}")
        return make(strategies[0]), [], [strategies[0].label]
    ref = Full()
    specs = [s.spec() for s in strategies if s.spec() != ref.spec()]
    if len(set(specs)) != len(specs):  # two lanes of one spec would share one owner's bytes
        raise InputError(f"strategies: {next(x for x in specs if specs.count(x) > 1)!r} is listed twice")
    reference = make(ref)
    lanes = [make(s) for s in strategies if s.spec() != ref.spec()]
    show = [s.label if s.spec() != ref.spec() else ref.label for s in strategies]
    return reference, lanes, show
