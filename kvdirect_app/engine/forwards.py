"""The forwards of one engine step: every lane's in one batched pass (or each alone); timed and measured per lane.

`Forwards.run(items, turn_start)` feeds each item's tokens to its lane's
cache (or its teacher-forced twin's).  Every forward goes through
`lockstep.run_batch`: the rows of a step with the same number of tokens in
one pass (`batch=True`), or each in a pass of its own (`batch=False`, the
reference for tests); either way each lane gets the same bits, the same ops
in its timings and the same byte accounting.

Times are the observer's regions (`observe.py`), read where they ran: a
lane's cache work (``cache_update``, and inside it ``recompute``,
``replay``, ``scoring``), its ``attention`` (its own call), its setup
(``other``: begin and end of its step, its masks), and ``shared``: the
pass's own region (projections, MLP, norms, embedding and head of all N
rows), charged by rows: 1/N to each (a lane's forward or a twin's).  Every
latency row has the same ops (`timing.OPS`, zero where an op did not run).

Teacher-forced twins are the measurement's own device, not a lane: their rows
ride in the lanes' pass (one read of the weights for all), and everything
their rows cost is the `twins` instrument's time, never a lane's.

Bytes: after each forward of a lane, its held bytes and its peak during the
forward by the run's meter (the allocator's ledger on CPU); the storage count
of what it lists beside them (declared); the formula's figures (`lanes.ByteBook`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from ..kernels.invariant import Kernels
from ..kernels.replay import check_rows_kernels
from ..measure.instruments import Instruments
from ..measure.memory import AllocationTracer
from ..measure.observe import SHARED, Observer, instrument
from ..measure.timing import OPS
from ..models.geometry import ModelGeometry
from ..models.threads import pin
from ..plain import rss
from ..strategies.base import ContractError, Forward
from ..strategies.scored import Scored, ScoredLayer, per_layer
from .hooks import InputTap
from .lanes import Lane
from .lockstep import Row, run_batch


@dataclass
class Item:
    lane: Lane
    ids: list[int]
    twin: bool = False
    more_prompt: bool = False  # a piece of a turn's prompt, and more pieces follow

    @property
    def cache(self):
        return self.lane.tf_cache if self.twin else self.lane.cache

    @property
    def owner(self):
        return self.lane.twin if self.twin else self.lane.owner


class Forwards:
    """The passes of a run.  `instruments.memory`: the run's memory mode ("allocator", "trace", "storage" or "none",
    as the engine resolved it); the observer carries the meter and the trace."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        geometry: ModelGeometry,
        observer: Observer,
        tracer: AllocationTracer,
        threads: int,
        batch: bool,
        kernels: Kernels,
        instruments: Instruments,
    ):
        self.model, self.device, self.geometry, self.observer, self.tracer = model, device, geometry, observer, tracer
        self.threads, self.batch, self.kernels, self.instruments = threads, batch, kernels, instruments
        self.process = psutil.Process()
        self.rss = self.rss_peak = None
        self.shared_ms: list[float] = []  # per decode pass of several rows: the pass's own work
        self.step_shared_ms = 0.0  # the shared pass's time in the passes since `run` was last called
        if not kernels.invariant:
            self.check_native()

    def check_native(self):
        """The native path's row kernels checked at the run's thread count, now (not inside the first timed step);
        torch's count is the process's: given back after."""
        previous = torch.get_num_threads()
        pin(self.threads)
        try:
            check_rows_kernels(self.model)
        finally:
            pin(previous)

    # Inference mode is entered per call, not around a turn: it is per thread, and a turn's generator may be
    # advanced from different threads.
    @torch.inference_mode()
    def run(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int = 0):
        """Feed every item, the rows with the same token count in one pass (the reference first, the twins after
        the lanes); `piece` > 0 continues a prompt fed in pieces."""
        pin(self.threads, self.kernels.torch_threads)
        self.step_shared_ms = 0.0
        groups: dict[int, list[Item]] = {}
        for item in items:
            groups.setdefault(len(item.ids), []).append(item)
        for group in groups.values():
            for rows in [group] if self.batch else [[item] for item in group]:
                self._pass(rows, tap, turn_start, piece)
        if turn_start:
            # A prompt piece's activations go back to the OS instead of staying in the heap, so the process's RSS
            # (what `top` and `/usr/bin/time` see) follows what the lanes hold (see rss.py).  Not after decode
            # steps: a step frees and reuses buffers of the same sizes, and the call costs ~5-10 ms.
            rss.release()

    def _pass(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int):
        """One pass of the model over `items` (same token count)."""
        obs = self.observer
        rows = [
            Row(item.owner, item.cache, item.ids, item.cache.get_seq_length(), item.more_prompt, item.lane.keeping)
            for item in items
        ]
        for row, item in zip(rows, items):
            # The last query of a turn's prompt (what reads the question): its attention at every layer, kept as
            # the lane's attention snapshot.
            row.snapshot = self.instruments.snapshots and turn_start and not item.twin and not item.more_prompt
        obs.reset_peaks(item.owner for item in items)
        mark = obs.mark()
        if self.tracer.enabled:
            with obs.region(instrument("trace"), "session"):
                self.tracer.start(SHARED.label, len(rows))
        try:
            run_batch(self.model, rows, obs, tap, self.device, self.kernels)
        finally:
            if self.tracer.enabled:
                with obs.region(instrument("trace"), "session"):
                    self.tracer.stop()
        spent = obs.since(mark)
        shared = spent.get((SHARED, "pass"), 0.0)
        self.step_shared_ms += 1e3 * shared
        if not turn_start and len(rows) > 1:
            self.shared_ms.append(1e3 * shared)
        for item, row in zip(items, rows):
            obs.charge((SHARED, "pass"), (item.owner, "shared"), shared / len(rows))
            times = {op: spent.get((item.owner, op), 0.0) for op in OPS}
            times["shared"] = shared / len(rows)
            times["total"] = sum(times.values())
            if item.twin:
                item.lane.tf_logits = row.logits
                continue
            item.lane.logits = row.logits
            if row.snapshot:
                item.lane.attention = {
                    "position": row.seen + len(item.ids) - 1,
                    "turn": len(item.lane.texts) + 1,
                    "layers": row.attention,
                }
            self._record(item, times, row.seen, turn_start, piece)

    def held(self, lane: Lane) -> int | None:
        """The lane's held bytes by the run's memory mode: the meter's, the trace's, the storages it lists
        (declared), none."""
        if self.instruments.memory == "allocator":
            return self.observer.held(lane.owner)
        if self.instruments.memory == "trace":
            return self.tracer.live(lane.label)
        if self.instruments.memory == "storage":
            return self.observer.declared(lane.cache)
        return None

    def _record(self, item: Item, times: dict, seen_before: int, turn_start: bool, piece: int):
        lane, q = item.lane, len(item.ids)
        obs = self.observer
        lane.history.extend(item.ids)
        lane.forwards.append(Forward(q, prompt=turn_start, open=item.more_prompt, keep=lane.keeping))
        if isinstance(lane.strategy, Scored):  # the budget, checked from outside the strategy's code
            why = over_budget(lane.cache, seen_before + q, lane.forwards)
            if why is not None:
                raise ContractError(why)
        lane.times.add(times, prefill=turn_start, piece=piece)
        if not turn_start:
            lane.book.turns[-1].decode_ms.append(1e3 * times["total"])
        strategy, geom = lane.strategy, self.geometry
        seen = seen_before + q
        formula = strategy.formula_persistent(geom, seen, lane.forwards)
        transient = strategy.formula_transient(geom, seen_before, q, turn_start and piece == 0, lane.forwards)
        state = peak = outside = None
        if self.instruments.memory != "none":
            declared = obs.declared(lane.cache)
            lane.book.declared(formula, declared)
            state = self.held(lane)
            outside = obs.outside(lane.owner)
            if self.instruments.memory == "allocator":
                peak = obs.peak(lane.owner)
            elif self.instruments.memory == "trace":
                peak = self.tracer.windows[lane.label].peak
                if obs.meter is not None:
                    lane.book.audit("step", seen, obs.held(lane.owner), obs.peak(lane.owner), state, peak)
            if peak is None:  # no peak to read here: the held bytes and the formula's buffers, labelled so
                peak = state + transient
        lane.book.step(seen, state, peak, formula, transient, outside)
        if self.instruments.rss:
            with obs.region(instrument("rss"), "read"):
                obs.counts["rss"] += 1
                self.rss = self.process.memory_info().rss
                self.rss_peak = max(self.rss_peak or 0, self.rss)


def over_budget(cache, seen: int, forwards: list) -> str | None:
    """Why a scored strategy's cache holds more tokens than its budget allows after `forwards` (the engine asks,
    outside the strategy's code, after every forward): the first evicting layer holding more than `Scored.stored`
    gives it; None where every layer is within it."""
    strategy = cache.strategy
    layers = [layer for layer in cache.layers if isinstance(layer, ScoredLayer)]
    if not layers:
        return None
    allowed = strategy.stored(seen, forwards, len(layers))
    for layer in layers:
        held = 0 if layer.keys is None else layer.keys.shape[-2]
        limit = per_layer(allowed, layer.rank)
        if held > limit:
            return (
                f"{strategy.label}: evicting layer {layer.rank + 1} of {layer.count} holds {held} tokens after "
                f"{seen} seen, more than the {limit} its budget allows there; allowed: at most its budget "
                "(`Scored.layer_budgets`, `limits`)"
            )
    return None
