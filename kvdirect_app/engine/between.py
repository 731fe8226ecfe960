"""The engine between turns: parking a session and resuming it, a saved context later turns start from, the thread
count (`Engine` is built of this and its other parts: `engine.py`)."""

from __future__ import annotations

import torch

from ..kernels.invariant import Kernels
from ..measure.observe import Owner
from ..models.prompts import InputError
from ..models.threads import pin
from .hooks import InputTap, model_lock

# Whose bytes a saved context is (`Engine.turn(save_context=True)`): the engine's copy, kept for later turns, no lane's.
CONTEXT = Owner("saved context", "engine")


class BetweenTurns:
    """Park, resume, a saved context, the thread count: what changes a session's state when no turn runs."""

    def park(self) -> dict:
        """Between turns: every cache keeps only its persistent state (full KV, inputs, anchors or token ids).

        The next `turn()` resumes each cache first (timed), rebuilding K/V exactly where the strategy
        rebuilds on resume.  Returns a "park" event with the parked bytes per strategy, measured and by formula.
        """
        if any(lane.active for lane in self.all_lanes):
            raise InputError("park: a turn is still running")
        event = {"type": "park", "lanes": {}}
        for lane in self.all_lanes:
            for owner, cache in self._caches(lane):
                with self._work(owner, "park"):
                    cache.park()
            seen = lane.cache.get_seq_length()
            record = {"seen": seen, "bytes": self._held(lane),
                      "formula_bytes": lane.strategy.formula_parked(self.geometry, seen, lane.forwards),
                      "resume_ms": None, "resume_peak_bytes": None}
            lane.book.check("parked", seen, record["bytes"], record["formula_bytes"])
            lane.parks.append(record)
            event["lanes"][lane.label] = record
        self.parked = True
        return event

    def resume(self) -> dict:
        """Rebuild every parked cache now (`turn()` does this itself when needed); returns a "resume" event."""
        with model_lock(self.model):
            tap = InputTap(self.model, self.loaded.device)
            try:
                self._resume(tap)
            finally:
                tap.close()
        return {"type": "resume", "lanes": {lane.label: lane.parks[-1] for lane in self.all_lanes}}

    def set_threads(self, threads: int) -> None:
        """Between turns: the forwards, rebuilds and replays that follow run at `threads`.  With invariant kernels
        the probe must pass at that count too (it runs now if it has not); a count where it fails is refused,
        not switched to other kernels."""
        if any(lane.active for lane in self.all_lanes):
            raise InputError("threads: a turn is still running")
        if threads < 1:
            raise InputError(f"threads: {threads} must be >= 1")
        probed = Kernels.for_model(self.loaded, self.kernels.requested, threads)
        if probed.mode != self.kernels.mode:
            raise InputError(f"threads: {threads} would change the kernels ({probed.reason}); allowed: a count where "
                             f"the {self.kernels.mode} kernels' probe passes")
        # The verdicts proven at `threads` from now on, everywhere the old ones were: the forwards, every cache
        # (its rebuilds and replays), the saved context's copies.
        self.kernels = self.forwards.kernels = probed
        for lane in self.all_lanes:
            for _, cache in self._caches(lane):
                cache.use_kernels(probed)
        for cache, _, _ in (self.saved_context or {}).values():
            cache.use_kernels(probed)
        self.threads = self.forwards.threads = threads
        if not probed.invariant:
            self.forwards.check_native()

    @torch.inference_mode()
    def _resume(self, tap: InputTap):
        pin(self.threads)
        with self.kernel_scope():
            self._resume_lanes(tap)
        self.parked = False

    def _resume_lanes(self, tap: InputTap):
        obs = self.observer
        for lane in self.all_lanes:
            for owner, cache in self._caches(lane):
                tap.target(cache)
                obs.reset_peaks([owner])
                mark = obs.mark()
                with self._work(owner, "resume"):
                    cache.resume()
                if owner is lane.owner:
                    spent = obs.since(mark)
                    lane.parks[-1]["resume_ms"] = 1e3 * sum(s for (o, _), s in spent.items() if o == owner)
                    lane.parks[-1]["resume_peak_bytes"] = (self.tracer.windows[owner.label].peak if self.tracer.enabled
                                                           else obs.peak(owner) if self.peak_source == "measured"
                                                           else None)

    def _save_context(self):
        """Every lane's cache as it stands now, with the length of its history: the engine's copy (its bytes are
        `CONTEXT`'s, no lane's), from which `_from_context` starts a later turn."""
        saved = {}
        for lane in self.all_lanes:
            with self.observer.region(CONTEXT, "save"):
                saved[lane.label] = (lane.cache.fork(), len(lane.history), list(lane.forwards))
        self.saved_context = saved

    def _from_context(self):
        """Every lane back at the saved context: a copy of its saved cache in place of its own (the copy is the
        lane's work and its bytes; its old cache is dropped), its history cut to the context's, its free run on the
        reference's history again (a teacher-forced twin goes with the answers it followed)."""
        for lane in self.all_lanes:
            cache, history, forwards = self.saved_context[lane.label]
            with self._work(lane.owner, "restore"):
                lane.cache = cache.fork()
            lane.history, lane.forwards, lane.pending = lane.history[:history], list(forwards), None
            lane.tf_cache = lane.tf_logits = None
            lane.diverged = False
        if self.instruments.compare and not self.solo:
            for lane in self.lanes:
                if lane.strategy.kv_comparable:
                    self.observer.compare_with(lane.owner, self.reference.cache)
