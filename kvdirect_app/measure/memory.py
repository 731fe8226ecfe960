"""Bytes measured by the allocator, not by the caches' own lists (docs/measurement.md, "Bytes: the allocator the
tensors live in").

The instrument is PyTorch's allocator reporting: every allocation and free
that c10's CPU allocator (or the CUDA caching allocator) performs on a thread
that runs the profiler with ``profile_memory`` is reported with its address,
size and time.  Nothing a strategy does can hide from it: a tensor kept in a
layer attribute, on a model module or in a closure was allocated by the
allocator like any other.

This is the auditor of the default instrument (the allocator's ledger,
`ledger.py`): slower (a profiler session per pass), it sees the same
allocations another way.  A `session()` runs a block (one lane's forward, or
one batched forward of several lanes) under the profiler on the calling
thread; inside it, `owner(name)` scopes say whose work runs (the engine's
observer opens them for each region: `scope`).  When the session ends, its allocation events
are folded, in time order, into a ledger of live blocks, each attributed to
the owner whose scope allocated it; allocations outside every owner scope
(the activations of a batched forward) belong to the session's `shared`
owner.  From the ledger:

* ``live(owner)``: bytes still allocated that the owner allocated, i.e. the
  state a lane holds after a step;
* each owner scope's `Window`: the highest the owner's live bytes went during
  the session (state + transient buffers), plus its share of the shared
  activations at that moment (all of them when the lane ran alone, 1/N of
  them in a batched forward of N lanes: the stated rule).

Work the measurement itself does inside a lane's forward (comparing K/V with
the reference, copying the logits the engine keeps) runs in an instrument's
region, whose scope here is marked as the harness's; what it allocates there
belongs to no lane.

On CUDA the caching allocator reports its blocks, not the bytes asked
for: each allocation rounded up to a multiple of 512 bytes, and a block
above 1 MiB cut from a cached one may keep up to 1 MiB more when the rest
is too small to split off.  So there the measurement is compared like for
like (`cuda_block_range`): the formula must equal the exact bytes of the
tensors the cache holds, and the measurement must lie within what the
allocator's rounding of those tensors allows; on the CPU both must be
equal to the byte.

Ops are not recorded inside a session (record functions are off on that
thread), so the profiler holds allocation events only and costs little; an
owner or harness scope turns them on for a moment to leave its mark.  Only
blocks on the traced device are counted.  One profiler session can run at a
time in a process, so sessions of different engines take turns (a
process-wide lock).  `bench run --memory none` turns tracing off, and then
only the formula is shown, labelled so.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch._C._autograd import _enable_record_function
from torch._C._profiler import ProfilerActivity, _ExperimentalConfig, _ExtraFields_Allocation
from torch.autograd import ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler, _prepare_profiler

from ..plain import rss
from . import ledger

HARNESS = "kvdirect::harness"
OWNER = "kvdirect::owner::"
_SESSION = threading.Lock()  # the profiler is one per process
_LOCAL = threading.local()  # .tracing: this thread is inside a session


def _config() -> ProfilerConfig:
    # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental
    return ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())


# The trace's own cost, seen from outside: the profiler's post-processing takes ~1.8 KB per allocation event (a
# 1,000-token AnchorKV replay step records ~87,000 events: +152 MiB of RSS, measured), freed after the fold but kept
# in glibc's heap; after a session this large the free pages go back to the OS (`rss.release`, ~5-10 ms).
RELEASE_EVENTS = 20_000
CUDA_BLOCK = 512  # the CUDA caching allocator's rounding (kMinBlockSize)
CUDA_UNSPLIT = 1 << 20  # a large block keeps a remainder below this unsplit (kSmallSize)


def cuda_block_range(sizes: list[int]) -> tuple[int, int]:
    """The least and most bytes CUDA's caching allocator reports for tensors of these exact sizes."""
    low = sum(-(-n // CUDA_BLOCK) * CUDA_BLOCK for n in sizes)
    return low, low + sum(CUDA_UNSPLIT for n in sizes if n > CUDA_UNSPLIT)


@dataclass
class Window:
    """What one owner's work did during a session."""

    owner: str
    start: int = 0  # owner's live bytes when the session began
    end: int = 0  # ... when it ended
    peak: int = 0  # highest of (owner's live + its share of the shared activations)
    allocated: int = 0  # bytes the owner's scopes allocated (everything, freed or not)


@contextlib.contextmanager
def _marked(name: str):
    """A scope the trace can see: its allocations become children of an op named `name`."""
    tracing = getattr(_LOCAL, "tracing", False)
    if tracing:
        _enable_record_function(True)
    try:
        with torch.profiler.record_function(name):
            if tracing:
                _enable_record_function(False)
            try:
                yield
            finally:
                if tracing:
                    _enable_record_function(True)
    finally:
        if tracing:
            _enable_record_function(False)


@contextlib.contextmanager
def harness():
    """Marks the measurement's own work outside an engine's regions (the shadow cache of `strategy_cache`): its
    allocations belong to no lane, for the trace, and are the ledger's "measurement" owner's (counted, reported
    as no lane's)."""
    with _marked(HARNESS), ledger.measurement():
        yield


_START = operator.attrgetter("start_time_ns")


class AllocationTracer:
    """A ledger of live allocator blocks by owner, fed by traced sessions.

    Parameters
    ----------
    device : the device whose blocks are counted (K/V live there).
    enabled : False makes sessions plain blocks and every figure None.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self.blocks: dict[int, tuple[int, str]] = {}  # address -> (bytes, owner)
        self.totals: dict[str, int] = defaultdict(int)
        self._activities = {ProfilerActivity.CPU}
        if self.device.type == "cuda":
            self._activities.add(ProfilerActivity.CUDA)
        self._windows: dict[str, Window] | None = None
        self.windows: dict[str, Window] = {}  # the last session's, by owner

    # --- reading -----------------------------------------------------------
    def live(self, owner: str) -> int | None:
        """Bytes the owner allocated that are still allocated."""
        return self.totals.get(owner, 0) if self.enabled else None

    # --- tracing -----------------------------------------------------------
    @contextlib.contextmanager
    def session(self, shared: str = "shared", share_among: int = 1):
        """One profiler session on this thread; owner scopes inside; folded when it ends.  Allocations outside
        every owner scope belong to `shared`, whose live bytes count 1/`share_among` in each owner's peak."""
        self.start(shared, share_among)
        try:
            yield self
        finally:
            self.stop()

    def start(self, shared: str = "shared", share_among: int = 1):
        """Begin a session (`session`); `stop` ends and folds it."""
        self._shared = (shared, max(1, share_among))
        self._windows = {}
        if not self.enabled:
            return
        _SESSION.acquire()
        _prepare_profiler(_config(), self._activities)
        _enable_profiler(_config(), self._activities)
        # Ops are not recorded (it is allocations we want, and recording every op would cost more than the
        # block): the allocator's reports still arrive, as roots of the event tree or children of a scope.
        _enable_record_function(False)
        _LOCAL.tracing = True

    def stop(self):
        windows, self._windows = self._windows, None
        if not self.enabled:
            return
        try:
            _LOCAL.tracing = False
            _enable_record_function(True)
            result = _disable_profiler()
            self._windows = windows
            events = self._fold(result, *self._shared)
            del result
        finally:
            self._windows = None
            _SESSION.release()
        self.windows = windows
        if events >= RELEASE_EVENTS:
            rss.release()

    def scope(self, owner):
        """The scope of a region of `owner` (an `observe.Owner`): a lane's or a twin's own, the session's shared
        work as it is, anyone else's (an instrument's, the engine's) no lane's."""
        if owner.kind in ("lane", "twin"):
            return self.owner(owner.label)
        if owner.kind == "shared":
            return contextlib.nullcontext()
        return _marked(HARNESS)  # the trace only: the ledger already counts the owner's work as its own

    @contextlib.contextmanager
    def owner(self, name: str):
        """Inside a session: the allocations of the block belong to `name`; yields its `Window` (filled when the
        session ends)."""
        window = self._windows.setdefault(name, Window(name)) if self._windows is not None else Window(name)
        if not self.enabled:
            yield window
            return
        with _marked(OWNER + name):
            yield window

    @contextlib.contextmanager
    def trace(self, owner: str):
        """A session whose every allocation is `owner`'s (one lane's work, alone); yields its `Window`."""
        with self.session(shared=owner):
            with self.owner(owner) as window:
                yield window

    # --- folding -----------------------------------------------------------
    def _counts(self, device: torch.device) -> bool:
        return device.type == self.device.type and (
            self.device.index is None or device.index in (None, -1, self.device.index)
        )

    def _events(self, result, shared: str) -> list[tuple[str, int, int]]:
        """(owner, address, bytes; negative: a free) in time order, from the session's event tree."""
        out = []
        other_devices = self.device.type != "cpu"  # on CPU every reported block is a CPU block

        def walk(events, owner):
            for event in events:
                fields = event.extra_fields
                if type(fields) is _ExtraFields_Allocation:
                    if not other_devices or self._counts(fields.device):
                        out.append((owner, fields.ptr, fields.alloc_size))
                    continue
                name = event.name
                inner = (
                    name[len(OWNER) :] if name.startswith(OWNER) else f"{owner}/harness" if name == HARNESS else owner
                )
                walk(sorted(event.children, key=_START), inner)

        walk(result.experimental_event_tree(), shared)
        return out

    def _fold(self, result, shared: str, share_among: int):
        """Replay the session's allocation events into the ledger and the owners' windows.

        A window's level only rises at an allocation (its owner's, or the shared activations' that every
        window carries 1/share_among of), so peaks are updated there and nowhere else."""
        blocks, totals, windows = self.blocks, self.totals, self._windows
        for window in windows.values():
            window.start = window.peak = totals.get(window.owner, 0)
        shared_start = totals.get(shared, 0)
        shared_window = windows.get(shared)
        others = [w for w in windows.values() if w.owner != shared]
        share = 0.0
        events = self._events(result, shared)
        for owner, ptr, size in events:
            if size > 0:
                stale = blocks.pop(ptr, None)  # freed while nobody traced: the address is reused
                if stale is not None:
                    totals[stale[1]] -= stale[0]
                blocks[ptr] = (size, owner)
                totals[owner] += size
                window = windows.get(owner)
                if window is not None:
                    window.allocated += size
                if owner == shared:
                    share = max(0, totals[shared] - shared_start) / share_among
                    if shared_window is not None and totals[shared] > shared_window.peak:
                        shared_window.peak = totals[shared]
                    for w in others:
                        level = totals.get(w.owner, 0) + share
                        if level > w.peak:
                            w.peak = int(level)
                elif window is not None:
                    level = totals[owner] + share
                    if level > window.peak:
                        window.peak = int(level)
            else:
                held = blocks.pop(ptr, None)
                if held is None:
                    continue  # allocated before tracing began (e.g. model weights): not anyone's state
                totals[held[1]] -= held[0]
                if held[1] == shared:
                    share = max(0, totals[shared] - shared_start) / share_among
        for window in windows.values():
            window.end = totals.get(window.owner, 0)
            window.peak = max(window.peak, window.end)
        return len(events)
