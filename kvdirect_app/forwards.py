"""The forwards of one engine step: every lane's in one batched pass (or each alone); timed and measured per lane.

`Forwards.run(items, turn_start)` feeds each item's tokens to its lane's
cache (or its teacher-forced twin's).  Every forward goes through
`lockstep.run_batch`: the rows of a step with the same number of tokens in
one pass (`batch=True`), or each in a pass of its own (`batch=False`, the
reference for tests); either way each lane gets the same bits, the same ops
in its timings and the same byte accounting (its own allocations; a pass's
activations attributed 1/N to each of its N rows).

Teacher-forced twins are the measurement's own device, not a lane: their rows
ride in the lanes' pass (one read of the weights for all), and everything
their rows cost (their attention, their cache's work, their 1/N shares of the
pass) is the `twins` instrument's time, never a lane's.

Every latency row has the same ops (`metrics.OPS`, zero where an op did not
run): a lane's cache work (recompute, replay, cache update, scoring), its
attention (its own call of the attention function), `shared` (the rest of
the pass: projections, MLP, norms, embedding and head of all N rows, charged
by rows: 1/N to each), and `other` (the lane's own work outside the model's
pass: its masks, the begin and end of its step).  The instruments' work
(`instruments.py`: comparisons, snapshots, the allocator trace's sessions,
the storage count, RSS) is timed apart, as theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil
import torch

from . import rss
from .geometry import ModelGeometry
from .hooks import InputTap
from .instruments import COUNTS, Instruments
from .kernels import Kernels
from .lanes import Lane
from .lockstep import Row, run_batch
from .memory import AllocationTracer
from .strategies.base import Forward, storage_sizes
from .replay import check_rows_kernels
from .threads import pin

SHARED = "shared pass"


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
    def owner(self) -> str:
        return self.lane.twin_owner if self.twin else self.lane.label


class Forwards:
    def __init__(self, model: torch.nn.Module, device: torch.device, geometry: ModelGeometry, tracer: AllocationTracer,
                 threads: int, batch: bool, kernels: Kernels, instruments: Instruments):
        self.model, self.device, self.geometry, self.tracer = model, device, geometry, tracer
        self.threads, self.batch, self.kernels = threads, batch, kernels
        self.instruments = instruments
        self.process = psutil.Process()
        self.rss = self.rss_peak = None
        self.shared_ms: list[float] = []  # per decode pass of several rows: the work no row did alone
        if not kernels.invariant:  # now, not inside the first traced, timed step; at the run's thread count, which
            previous = torch.get_num_threads()  # is the process's (torch's count is global): given back after
            pin(threads)
            try:
                check_rows_kernels(model)
            finally:
                pin(previous)

    # Inference mode is entered per call, not around a turn: it is per thread, and a turn's generator may be
    # advanced from different threads.
    @torch.inference_mode()
    def run(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int = 0):
        """Feed every item, the rows with the same token count in one pass (the reference first, the twins after
        the lanes); `piece` > 0 continues a prompt fed in pieces."""
        pin(self.threads)
        groups: dict[int, list[Item]] = {}
        for item in items:
            groups.setdefault(len(item.ids), []).append(item)
        for group in groups.values():
            for rows in ([group] if self.batch else [[item] for item in group]):
                self._pass(rows, tap, turn_start, piece)
        if turn_start:
            # A prompt piece's activations go back to the OS instead of staying in the heap, so the process's RSS
            # (what `top` and `/usr/bin/time` see) follows what the lanes hold (see rss.py).  Not after decode
            # steps: a step frees and reuses buffers of the same sizes, and the call costs ~5-10 ms.
            rss.release()

    def _pass(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int):
        """One pass of the model over `items` (same token count)."""
        inst = self.instruments
        rows = [Row(item.owner, item.cache, item.ids, item.cache.get_seq_length(), item.more_prompt) for item in items]
        for row, item in zip(rows, items):
            # The last query of a turn's prompt (what reads the question): its attention at every layer, kept as
            # the lane's attention snapshot; measurement work, outside every timer and every lane's bytes.
            row.snapshot = inst.snapshots and turn_start and not item.twin and not item.more_prompt
        t0 = time.perf_counter()
        with self.tracer.session(shared=SHARED, share_among=len(rows)):
            t1 = time.perf_counter()
            wall = run_batch(self.model, rows, self.tracer, tap, self.device, self.kernels)
            t2 = time.perf_counter()
        if self.tracer.enabled:  # the profiler's start, and its stop and fold (its recording runs inside the pass)
            inst.add("trace", (t1 - t0) + (time.perf_counter() - t2), 1)
        ops = [item.cache.take_timers() for item in items]
        # Inside the pass: each row's attention and cache work, the measurement's comparisons, AnchorKV's heap release
        # (nobody's: it falls in the step's unattributed rest), and the shared rest.
        inside = sum(row.attention_s + o["recompute"] + o["cache_update"] + o["scoring"] + o["replay"] + o["compare"]
                     + o.get("release", 0.0) + row.snapshot_s for row, o in zip(rows, ops))
        shared = max(0.0, wall - inside)
        if not turn_start and len(rows) > 1:
            self.shared_ms.append(1e3 * shared)
        for item, row, o in zip(items, rows, ops):
            times = {"recompute": o["recompute"], "replay": o["replay"], "cache_update": o["cache_update"],
                     "scoring": o["scoring"], "attention": row.attention_s, "shared": shared / len(rows),
                     "other": row.setup_s}
            times["total"] = sum(times.values())
            if item.twin:
                item.lane.tf_logits = row.logits
                inst.add("twins", times["total"] + o["compare"] + row.snapshot_s, 1)
                continue
            inst.add("compare", o["compare"])
            inst.add("snapshot", row.snapshot_s)
            item.lane.logits = row.logits
            if row.snapshot:
                item.lane.attention = {"position": row.seen + len(item.ids) - 1, "turn": len(item.lane.texts) + 1,
                                       "layers": row.attention}
            self._record(item, times, row.window, row.seen, turn_start, piece)

    def held(self, lane: Lane) -> int | None:
        """The lane's held bytes by the run's memory instrument: the allocator's ledger (trace), the distinct
        storages of its cache's tensors (storage), none."""
        if self.instruments.memory == "trace":
            return self.tracer.live(lane.label)
        if self.instruments.memory == "storage":
            t0 = time.perf_counter()
            held = storage_held(lane.cache)
            self.instruments.add("storage", time.perf_counter() - t0)
            return held
        return None

    def _record(self, item: Item, times: dict, window, seen_before: int, turn_start: bool, piece: int):
        lane, q = item.lane, len(item.ids)
        inst = self.instruments
        lane.history.extend(item.ids)
        lane.forwards.append(Forward(q, prompt=turn_start, open=item.more_prompt))
        lane.times.add(times, prefill=turn_start, piece=piece)
        if not turn_start:
            lane.book.turns[-1].decode_ms.append(1e3 * times["total"])
        strategy, geom = lane.strategy, self.geometry
        seen = seen_before + q
        state = peak = None
        if inst.memory == "trace":
            state, peak = self.tracer.live(lane.label), window.peak
            t0 = time.perf_counter()  # the storage count beside it: the trace audits it
            held = storage_held(lane.cache)
            lane.book.audit("step", seen, held, held + lane.cache.transient_bytes(), state, peak)
            inst.add("storage", time.perf_counter() - t0)
        elif inst.memory == "storage":
            t0 = time.perf_counter()
            state = storage_held(lane.cache)
            peak = state + lane.cache.transient_bytes()
            inst.add("storage", time.perf_counter() - t0)
        lane.book.step(seen, state, peak, strategy.formula_persistent(geom, seen, lane.forwards),
                       strategy.formula_transient(geom, seen_before, q, turn_start and piece == 0, lane.forwards))
        if inst.rss:
            t0 = time.perf_counter()
            self.rss = self.process.memory_info().rss
            self.rss_peak = max(self.rss_peak or 0, self.rss)
            inst.add("rss", time.perf_counter() - t0, 1)


def storage_held(cache) -> int:
    """Bytes of the distinct storages behind every tensor the cache holds (a view counts its whole buffer, once)."""
    COUNTS["storage"] += 1
    return sum(storage_sizes(*cache.state_tensors()).values())
