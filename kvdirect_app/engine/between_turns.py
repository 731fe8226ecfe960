"""The engine between turns: parking a session and resuming it, a saved context later turns start from, the thread
count's kernels.  Plain functions of the lanes and what they touch, each named in its inputs (`Engine.park`, `resume`,
`set_threads` and the turn's saved context call them, and keep the state they change: `runner.py`)."""

from __future__ import annotations

from typing import Callable, ContextManager

from ..kernels.invariant import Kernels
from ..measure.memory import AllocationTracer
from ..measure.observe import Observer, Owner
from ..models.geometry import ModelGeometry
from ..models.loading import LoadedModel
from ..models.prompts import InputError
from .hooks import InputTap
from .lanes import Lane

# Whose bytes a saved context is (`Engine.turn(save_context=True)`): the engine's copy, kept for later turns, no lane's.
CONTEXT = Owner("saved context", "engine")

# An owner's work outside a pass, as a region of the observer (`lane_building.work_region`, held as `Engine._work`).
Work = Callable[[Owner, str], ContextManager]


def park(lanes: list[Lane], work: Work, geometry: ModelGeometry, held: Callable[[Lane], int | None]) -> dict:
    """Every lane's caches keep only their persistent state; returns the "park" event with the parked bytes per
    lane, measured (`held`) and by formula."""
    if any(lane.active for lane in lanes):
        raise InputError("park: a turn is still running")
    event = {"type": "park", "lanes": {}}
    for lane in lanes:
        for owner, cache in lane.caches():
            with work(owner, "park"):
                cache.park()
        seen = lane.cache.get_seq_length()
        record = {
            "seen": seen,
            "bytes": held(lane),
            "formula_bytes": lane.strategy.formula_parked(geometry, seen, lane.forwards),
            "resume_ms": None,
            "resume_peak_bytes": None,
        }
        lane.book.check("parked", seen, record["bytes"], record["formula_bytes"])
        lane.parks.append(record)
        event["lanes"][lane.label] = record
    return event


def resume_lanes(
    lanes: list[Lane], tap: InputTap, observer: Observer, work: Work, tracer: AllocationTracer, peak_source: str | None
):
    """Every parked cache rebuilt, each lane's time and peak for it kept on its latest park's record."""
    for lane in lanes:
        for owner, cache in lane.caches():
            tap.target(cache)
            observer.reset_peaks([owner])
            mark = observer.mark()
            with work(owner, "resume"):
                cache.resume()
            if owner is lane.owner:
                spent = observer.since(mark)
                lane.parks[-1]["resume_ms"] = 1e3 * sum(s for (o, _), s in spent.items() if o == owner)
                lane.parks[-1]["resume_peak_bytes"] = (
                    tracer.windows[owner.label].peak
                    if tracer.enabled
                    else observer.peak(owner)
                    if peak_source == "measured"
                    else None
                )


def kernels_at(loaded: LoadedModel, kernels: Kernels, threads: int, lanes: list[Lane]) -> Kernels:
    """The kernels proven at `threads` (the probe runs now if it has not); a count where they would differ from
    `kernels` is refused, not switched to other kernels."""
    if any(lane.active for lane in lanes):
        raise InputError("threads: a turn is still running")
    if threads < 1:
        raise InputError(f"threads: {threads} must be >= 1")
    probed = Kernels.for_model(loaded, kernels.requested, threads)
    if probed.mode != kernels.mode:
        raise InputError(
            f"threads: {threads} would change the kernels ({probed.reason}); allowed: a count where "
            f"the {kernels.mode} kernels' probe passes"
        )
    return probed


def use_kernels(kernels: Kernels, lanes: list[Lane], saved_context: dict | None):
    """Every cache (its rebuilds and replays) and the saved context's copies on `kernels` from now on."""
    for lane in lanes:
        for _, cache in lane.caches():
            cache.use_kernels(kernels)
    for cache, _, _ in (saved_context or {}).values():
        cache.use_kernels(kernels)


def save_context(lanes: list[Lane], observer: Observer) -> dict:
    """Every lane's cache as it stands now, with the length of its history: the engine's copy (its bytes are
    `CONTEXT`'s, no lane's), from which `from_context` starts a later turn.  label -> (cache, history, forwards)."""
    saved = {}
    for lane in lanes:
        with observer.region(CONTEXT, "save"):
            saved[lane.label] = (lane.cache.fork(), len(lane.history), list(lane.forwards))
    return saved


def from_context(lanes: list[Lane], saved: dict, work: Work):
    """Every lane back at the saved context: a copy of its saved cache in place of its own (the copy is the
    lane's work and its bytes; its old cache is dropped), its history cut to the context's, its free run on the
    reference's history again (a teacher-forced twin goes with the answers it followed)."""
    for lane in lanes:
        cache, history, forwards = saved[lane.label]
        with work(lane.owner, "restore"):
            lane.cache = cache.fork()
        lane.history, lane.forwards, lane.pending = lane.history[:history], list(forwards), None
        lane.tf_cache = lane.tf_logits = None
        lane.diverged = False
