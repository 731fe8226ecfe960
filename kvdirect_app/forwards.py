"""The forwards of one engine step: every lane's in one batched pass (or each alone); timed and measured per lane.

`Forwards.run(items, turn_start)` feeds each item's tokens to its lane's
cache (or its teacher-forced twin's).  Every forward goes through
`lockstep.run_batch`: the lanes of a step with the same number of tokens in
one pass (`batch=True`), or each in a pass of its own (`batch=False`, the
reference for tests); either way each lane gets the same bits, the same ops
in its timings and the same byte accounting (its own allocations; a pass's
activations attributed 1/N to each of its N rows).

Teacher-forced twins are the measurement's own device, not a lane: they go
through the model in a pass of their own after the lanes', so no lane's
figures depend on how many twins there are; their time is reported apart
(`twins_ms`) as the measurement's overhead.

Every latency row has the same ops (`metrics.OPS`, zero where an op did not
run): a lane's cache work (recompute, replay, cache update, scoring), its
attention (the attention function alone, softmax(QK^T)V), `shared` (the rest
of the pass: projections, MLP, norms, embedding and head of all N rows,
charged 1/N to each; all of it for a lane alone), and `other` (the lane's own
work outside the model's pass: its masks, the begin and end of its step).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from . import rss
from .geometry import ModelGeometry
from .hooks import InputTap
from .kernels import Kernels
from .lanes import Lane
from .lockstep import Row, run_batch
from .memory import AllocationTracer
from .strategies.base import Forward
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
                 threads: int, batch: bool, kernels: Kernels):
        self.model, self.device, self.geometry, self.tracer = model, device, geometry, tracer
        self.threads, self.batch, self.kernels = threads, batch, kernels
        self.snapshots = True  # each turn's attention snapshot (`Lane.attention`)
        self.process = psutil.Process()
        self.rss = self.rss_peak = 0
        self.shared_ms: list[float] = []  # per decode pass of several lanes: the work no lane did alone
        self.twins_ms: list[float] = []  # per decode step with twins: their passes (the measurement's overhead)
        pin(threads)
        if not kernels.invariant:
            check_rows_kernels(model)  # now, not inside the first traced, timed step

    # Inference mode is entered per call, not around a turn: it is per thread, and a turn's generator may be
    # advanced from different threads.
    @torch.inference_mode()
    def run(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int = 0):
        """Feed every item: the lanes first (the reference's group first), then the teacher-forced twins;
        `piece` > 0 continues a prompt fed in pieces."""
        pin(self.threads)
        twins_s = 0.0
        for twins in (False, True):
            groups: dict[int, list[Item]] = {}
            for item in items:
                if item.twin == twins:
                    groups.setdefault(len(item.ids), []).append(item)
            for group in groups.values():
                for rows in ([group] if self.batch else [[item] for item in group]):
                    wall = self._pass(rows, tap, turn_start, piece)
                    twins_s += wall if twins else 0.0
        if not turn_start and any(item.twin for item in items):
            self.twins_ms.append(1e3 * twins_s)
        if turn_start:
            # A prompt piece's activations go back to the OS instead of staying in the heap, so the process's RSS
            # (what `top` and `/usr/bin/time` see) follows what the lanes hold (see rss.py).  Not after decode
            # steps: a step frees and reuses buffers of the same sizes, and the call costs ~5-10 ms.
            rss.release()

    def _pass(self, items: list[Item], tap: InputTap, turn_start: bool, piece: int) -> float:
        """One pass of the model over `items` (same token count); returns its wall time."""
        rows = [Row(item.owner, item.cache, item.ids, item.cache.get_seq_length(), item.more_prompt) for item in items]
        for row, item in zip(rows, items):
            # The last query of a turn's prompt (what reads the question): its attention at every layer, kept as
            # the lane's attention snapshot; measurement work, outside every timer and every lane's bytes.
            row.snapshot = self.snapshots and turn_start and not item.twin and not item.more_prompt
        with self.tracer.session(shared=SHARED, share_among=len(rows)):
            wall = run_batch(self.model, rows, self.tracer, tap, self.device, self.kernels)
        ops = [item.cache.take_timers() for item in items]
        # Inside the pass: each row's attention and cache work, the measurement's comparisons, and the shared rest.
        inside = sum(row.attention_s + o["recompute"] + o["cache_update"] + o["scoring"] + o["replay"] + o["compare"]
                     + row.snapshot_s for row, o in zip(rows, ops))
        shared = max(0.0, wall - inside)
        if not turn_start and len(rows) > 1 and not items[0].twin:
            self.shared_ms.append(1e3 * shared)
        for item, row, o in zip(items, rows, ops):
            if item.twin:
                item.lane.tf_logits = row.logits
                continue
            item.lane.logits = row.logits
            if row.snapshot:
                item.lane.attention = {"position": row.seen + len(item.ids) - 1, "turn": len(item.lane.texts) + 1,
                                       "layers": row.attention}
            item.lane.kv_digest = row.digest  # what it handed attention at its latest forward
            times = {"recompute": o["recompute"], "replay": o["replay"], "cache_update": o["cache_update"],
                     "scoring": o["scoring"], "attention": row.attention_s, "shared": shared / len(rows),
                     "other": row.setup_s}
            times["total"] = sum(times.values())
            self._record(item, times, row.window, row.seen, turn_start, piece)
        return wall

    def _record(self, item: Item, times: dict, window, seen_before: int, turn_start: bool, piece: int):
        lane, q = item.lane, len(item.ids)
        lane.history.extend(item.ids)
        lane.forwards.append(Forward(q, prompt=turn_start, open=item.more_prompt))
        lane.times.add(times, prefill=turn_start, piece=piece)
        if not turn_start:
            lane.book.turns[-1].decode_ms.append(1e3 * times["total"])
        strategy, geom = lane.strategy, self.geometry
        seen = seen_before + q
        lane.book.step(seen, self.tracer.live(lane.label), window, strategy.formula_persistent(geom, seen, lane.forwards),
                       strategy.formula_transient(geom, seen_before, q, turn_start and piece == 0, lane.forwards))
        self.rss = self.process.memory_info().rss
        self.rss_peak = max(self.rss_peak, self.rss)
