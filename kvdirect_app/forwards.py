"""The forwards of one engine step: alone, or every lane in one batched pass; timed and measured per lane.

`Forwards.run(items, turn_start)` feeds each item's tokens to its lane's
cache (or its teacher-forced twin's).  Items with the same number of tokens
go through the model together (`lockstep.run_batch`) unless batching is off
(`batch=False`, the reference for tests), in which case each runs alone as
before.  Either way each lane gets the same bits, the same per-op timings
(its own work measured; a batched pass's shared work attributed 1/N) and the
same byte accounting (its own allocations; a batched pass's activations
attributed 1/N).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from . import compat
from .geometry import ModelGeometry
from .hooks import InputTap
from .lanes import Lane
from .lockstep import Row, run_batch
from .memory import AllocationTracer, harness
from .metrics import clock
from .replay import check_rows_kernels
from .threads import pin

SHARED = "shared pass"


@dataclass
class Item:
    lane: Lane
    ids: list[int]
    twin: bool = False

    @property
    def cache(self):
        return self.lane.tf_cache if self.twin else self.lane.cache

    @property
    def owner(self) -> str:
        return self.lane.twin_owner if self.twin else self.lane.label


class Forwards:
    def __init__(self, model: torch.nn.Module, device: torch.device, geometry: ModelGeometry, tracer: AllocationTracer,
                 threads: int, batch: bool):
        self.model, self.device, self.geometry, self.tracer = model, device, geometry, tracer
        self.threads, self.batch = threads, batch
        self.process = psutil.Process()
        self.rss = self.rss_peak = 0
        self.shared_ms: list[float] = []  # per batched decode pass: the work no lane did alone
        pin(threads)
        check_rows_kernels(model)  # now, not inside the first traced, timed step

    # Inference mode is entered per call, not around a turn: it is per thread, and a turn's generator may be
    # advanced from different threads.
    @torch.inference_mode()
    def run(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int = 0):
        """Feed every item; `piece` > 0 continues a prompt fed in pieces."""
        pin(self.threads)
        groups: dict[int, list[Item]] = {}
        for item in items:
            groups.setdefault(len(item.ids), []).append(item)
        for group in groups.values():  # the group holding the reference (the first item) goes first
            if self.batch and len(group) > 1:
                self._together(group, tap, turn_start, piece)
            else:
                for item in group:
                    self._alone(item, tap, turn_start, piece)

    def _alone(self, item: Item, tap: InputTap, turn_start: bool, piece: int):
        cache, lane = item.cache, item.lane
        tap.target(cache)
        seen_before = cache.get_seq_length()
        x = torch.tensor([item.ids], device=self.device)
        with self.tracer.trace(item.owner) as window:
            t0 = clock(self.device)
            cache.begin_step(item.ids)
            logits = compat.forward_step(self.model, x, cache)
            cache.end_step()
            with harness():  # the engine's copy: what the lane's forward allocated for them is freed now
                logits = logits.clone()
            wall = clock(self.device) - t0
            self._set_logits(item, logits)
        ops = cache.take_timers()
        if item.twin:
            return
        total = wall - ops["compare"]
        in_attention = ops["recompute"] + ops["cache_update"] + ops["scoring"]
        attention = tap.attention_s - ops["compare"] - in_attention
        replay = ops.get("replay", 0.0)  # before the decoder layers, outside attention
        times = {"recompute": ops["recompute"], "cache_update": ops["cache_update"], "scoring": ops["scoring"],
                 "attention": attention, "other": total - (tap.attention_s - ops["compare"]) - replay,
                 "total": total}
        if "replay" in ops:
            times["replay"] = replay
        self._record(item, times, window, seen_before, turn_start, piece)

    def _together(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int):
        rows = [Row(item.owner, item.cache, item.ids, item.cache.get_seq_length()) for item in items]
        with self.tracer.session(shared=SHARED, share_among=len(rows)):
            wall = run_batch(self.model, rows, self.tracer, tap, self.device)
        ops = [item.cache.take_timers() for item in items]
        own = [row.own_s + o["recompute"] + o["cache_update"] + o["scoring"] + o.get("replay", 0.0)
               for row, o in zip(rows, ops)]
        shared = max(0.0, wall - sum(own) - sum(o["compare"] for o in ops))
        if not turn_start:
            self.shared_ms.append(1e3 * shared)
        for item, row, o, mine in zip(items, rows, ops, own):
            self._set_logits(item, row.logits)
            if item.twin:
                continue
            times = {"recompute": o["recompute"], "cache_update": o["cache_update"], "scoring": o["scoring"],
                     "attention": row.own_s, "shared": shared / len(rows), "other": 0.0,
                     "total": mine + shared / len(rows)}
            if "replay" in o:
                times["replay"] = o["replay"]
            self._record(item, times, row.window, row.seen, turn_start, piece)

    @staticmethod
    def _set_logits(item: Item, logits: torch.Tensor):
        if item.twin:
            item.lane.tf_logits = logits
        else:
            item.lane.logits = logits

    def _record(self, item: Item, times: dict, window, seen_before: int, turn_start: bool, piece: int):
        lane, q = item.lane, len(item.ids)
        lane.history.extend(item.ids)
        lane.forwards.append((q, turn_start and piece == 0))
        lane.times.add(times, prefill=turn_start, piece=piece)
        if not turn_start:
            lane.book.turns[-1].decode_ms.append(1e3 * times["total"])
        strategy, geom = lane.strategy, self.geometry
        seen = seen_before + q
        lane.book.step(seen, self.tracer.live(lane.label), window, strategy.formula_persistent(geom, seen, lane.forwards),
                       strategy.formula_transient(geom, seen_before, q, turn_start and piece == 0, lane.forwards))
        self.rss = self.process.memory_info().rss
        self.rss_peak = max(self.rss_peak, self.rss)
