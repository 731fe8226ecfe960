"""Bytes measured by the allocator, not by the caches' own lists (DESIGN.md, "Metrics").

The instrument is PyTorch's allocator reporting: every allocation and free
that c10's CPU allocator (or the CUDA caching allocator) performs on a thread
that runs the profiler with ``profile_memory`` is reported with its address,
size and time.  Nothing a strategy does can hide from it: a tensor kept in a
layer attribute, on a model module or in a closure was allocated by the
allocator like any other.

`AllocationTracer.trace(owner)` runs a block (one lane's forward, a fork,
a park, a resume) under the profiler on the calling thread and folds its
allocation events into a ledger of live blocks, each attributed to the owner
whose block allocated it.  From the ledger:

* ``live(owner)``: bytes still allocated that the owner allocated, i.e. the
  state a lane holds after a step;
* the window's ``peak``: the highest the owner's live bytes went during the
  block: state + transient buffers + activations of that forward.

Work the measurement itself does inside a lane's forward (comparing K/V with
the reference, copying the logits the engine keeps) runs in `harness()`
scopes; what it allocates there belongs to no lane.

Only blocks on the traced device are counted.  Ops are not recorded inside a
traced block (record functions are off on that thread), so the profiler
holds allocation events only and costs little; a harness scope turns them
back on to mark itself.  One profiler session can run at a time in a
process, so traced blocks of different engines take turns (a process-wide
lock).  `bench run --memory none` turns tracing off, and then only the
formula is shown, labelled so.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.autograd import ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._autograd import _enable_record_function
from torch._C._profiler import ProfilerActivity, _ExperimentalConfig, _ExtraFields_Allocation

HARNESS = "kvdirect::harness"
_SESSION = threading.Lock()  # the profiler is one per process
_LOCAL = threading.local()  # .tracing: this thread is inside a traced block


def _config() -> ProfilerConfig:
    # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental
    return ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())


@dataclass
class Window:
    """What one traced block did, for its owner."""

    owner: str
    start: int = 0  # owner's live bytes when the block began
    end: int = 0  # ... when it ended
    peak: int = 0  # highest during the block
    allocated: int = 0  # bytes the block allocated (everything, freed or not)


class AllocationTracer:
    """A ledger of live allocator blocks by owner, fed by traced blocks.

    Parameters
    ----------
    device : the device whose blocks are counted (K/V live there).
    enabled : False makes `trace` a plain block and every figure None.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self.blocks: dict[int, tuple[int, str]] = {}  # address -> (bytes, owner)
        self.totals: dict[str, int] = defaultdict(int)
        self._activities = {ProfilerActivity.CPU}
        if self.device.type == "cuda":
            self._activities.add(ProfilerActivity.CUDA)

    # --- reading -----------------------------------------------------------
    def live(self, owner: str) -> int | None:
        """Bytes the owner allocated that are still allocated."""
        return self.totals.get(owner, 0) if self.enabled else None

    # --- tracing -----------------------------------------------------------
    @contextlib.contextmanager
    def trace(self, owner: str):
        """Run the block under the allocator trace; yields a `Window` filled in when the block ends."""
        window = Window(owner)
        if not self.enabled:
            yield window
            return
        with _SESSION:
            window.start = self.totals.get(owner, 0)
            _prepare_profiler(_config(), self._activities)
            _enable_profiler(_config(), self._activities)
            # Ops are not recorded (it is allocations we want, and recording every op would cost more than
            # the block): the allocator's reports still arrive, as roots of the event tree.
            _enable_record_function(False)
            _LOCAL.tracing = True
            try:
                yield window
            finally:
                _LOCAL.tracing = False
                _enable_record_function(True)
                result = _disable_profiler()
                self._fold(result, window)

    def _counts(self, device: torch.device) -> bool:
        return device.type == self.device.type and (self.device.index is None or device.index in (None, -1, self.device.index))

    def _fold(self, result, window: Window):
        """Replay the block's allocation events, in time order, into the ledger and the window's peak.

        With ops unrecorded, the event tree's roots are the allocations themselves, in time order, and the
        harness scopes (whose allocations belong to no lane); this loop runs per allocation, so it is kept lean.
        """
        owner, blocks, totals = window.owner, self.blocks, self.totals
        other_devices = self.device.type != "cpu"  # on CPU every reported block is a CPU block
        running = peak = window.start
        allocated = 0
        for event in result.experimental_event_tree():
            fields = event.extra_fields
            if type(fields) is not _ExtraFields_Allocation:
                self._harness(event, f"{owner}/harness")
                continue
            if other_devices and not self._counts(fields.device):
                continue
            ptr, size = fields.ptr, fields.alloc_size
            if size > 0:
                stale = blocks.pop(ptr, None)  # freed while nobody traced: the address is reused
                if stale is not None:
                    totals[stale[1]] -= stale[0]
                    if stale[1] == owner:
                        running -= stale[0]
                blocks[ptr] = (size, owner)
                running += size
                allocated += size
                if running > peak:
                    peak = running
            else:
                held = blocks.pop(ptr, None)
                if held is None:
                    continue  # allocated before tracing began (e.g. model weights): not anyone's state
                totals[held[1]] -= held[0]
                if held[1] == owner:
                    running -= held[0]
        totals[owner] += allocated
        window.allocated = allocated
        window.end = totals.get(owner, 0)
        window.peak = max(peak, window.end)

    def _harness(self, scope, owner: str):
        """Allocations inside a harness scope, in order (nested ops are recorded there)."""
        events = []
        stack = [scope]
        while stack:
            event = stack.pop()
            fields = event.extra_fields
            if type(fields) is _ExtraFields_Allocation:
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size, fields.device))
            else:
                stack.extend(event.children)
        for _, ptr, size, device in sorted(events, key=lambda e: e[0]):
            if not self._counts(device):
                continue
            if size > 0:
                stale = self.blocks.pop(ptr, None)
                if stale is not None:
                    self.totals[stale[1]] -= stale[0]
                self.blocks[ptr] = (size, owner)
                self.totals[owner] += size
            else:
                held = self.blocks.pop(ptr, None)
                if held is not None:
                    self.totals[held[1]] -= held[0]


@contextlib.contextmanager
def harness():
    """Marks work the measurement does inside a lane's forward; its allocations belong to no lane."""
    tracing = getattr(_LOCAL, "tracing", False)
    if tracing:
        _enable_record_function(True)
    try:
        with torch.profiler.record_function(HARNESS):
            yield
    finally:
        if tracing:
            _enable_record_function(False)
