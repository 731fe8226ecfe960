"""The engine's observers: who is working now, for how long, with whose memory (docs/measurement.md,
"Strategies only cache; everything is measured from outside").

A strategy only caches: its settings, what it keeps, what it drops or rebuilds.  Everything measured about it is
measured here, from outside its code:

* **Regions.**  Every piece of a step runs in a region of one owner and one op (`Observer.region`): a lane's
  cache update, rebuild (``recompute``, ``replay``), ``scoring``, ``attention`` or setup (``other``); a
  teacher-forced twin's; the shared pass (the linears, norms, embedding and head over every row); an
  instrument's work; the engine's own (choosing tokens, detokenising, building events).  A region's time is
  read from the clock where it runs, on entry and exit, less the regions nested in it (`parts`): the parts of a
  step are what the clocks covered, and what no clock covered is the step's unattributed rest.  On an
  accelerator the clock waits for the device's queued work first.
* **Seams.**  The ops inside a strategy's update (its rebuild, replay, scoring) are timed by subclasses the
  observer puts in place of the cache's own classes (`watch`): the strategy calls its own methods, and the
  observed subclass times each call as that op of whoever's region it runs in, and counts the tokens rebuilt.
* **Memory.**  A region's allocations are its owner's (`meters.py`: the allocator's ledger on the CPU, the device
  allocator's counters on CUDA and MPS), or another's where the region says so (a lane's attention: its time is
  the lane's, its workspace and output are activations, the shared pass's, as the model's other activations
  are); with ``--memory trace`` the allocation trace (`memory.py`) sees the same regions as owner scopes.  What a
  meter costs is the memory instrument's time, not the region's.
* **Comparison.**  What a strategy hands attention at a layer against what the full cache holds there after the
  same step (`compare`), and the tokens it rebuilt while it was compared.

Instruments off: no meter, no trace, no comparison, nothing counted; the clocks still run (they are the
lanes' latency figures) and cost a perf_counter per region.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from ..strategies import Strategy
from . import ledger

_ACTIVE = threading.local()  # .observers: the observers with an open region on this thread, innermost last


@dataclass(frozen=True)
class Owner:
    """Whose work a region is: kind ``lane`` (a strategy's cache, the reference's too), ``twin`` (a teacher-forced
    twin: the measurement's device), ``shared`` (the pass's work for every row), ``instrument`` or ``engine``."""

    label: str
    kind: str


SHARED = Owner("shared pass", "shared")
ENGINE = Owner("engine", "engine")
INSTRUMENTS = (
    "compare",
    "twins",
    "agreement",
    "snapshot",
    "digest",
    "allocator",
    "storage",
    "trace",
    "rss",
    "rows check",
)
INSTRUMENT = {name: Owner(name, "instrument") for name in INSTRUMENTS}


def instrument(name: str) -> Owner:
    return INSTRUMENT[name]


@dataclass
class KVRecord:
    """What the comparison saw of one owner's cache: layers compared, whether every K/V was equal, the largest
    differences, shapes that did not match, and the tokens rebuilt while compared."""

    compared: int = 0
    equal: bool = True
    max_dk: float = 0.0
    max_dv: float = 0.0
    shape_mismatches: int = 0
    rebuilt: int = 0
    layers: set = field(default_factory=set)

    def report(self) -> dict:
        if not self.compared:
            return {
                "kv_exact": None,
                "max_abs_dk": None,
                "max_abs_dv": None,
                "layers_compared": 0,
                "rebuilt_token_layers": 0,
                "shape_mismatches": 0,
            }
        return {
            "layers_compared": len(self.layers),
            "kv_exact": self.equal,
            "max_abs_dk": self.max_dk,
            "max_abs_dv": self.max_dv,
            "rebuilt_token_layers": self.rebuilt,
            "shape_mismatches": self.shape_mismatches,
        }


def current() -> "tuple[Observer, Owner, str] | None":
    """The observer, owner and op of this thread's innermost open region, if any."""
    stack = getattr(_ACTIVE, "observers", None)
    if not stack:
        return None
    observer = stack[-1]
    owner, op = observer._stack[-1][:2]
    return observer, owner, op


class Observer:
    """One run's regions, clocks, meters and comparisons.

    Parameters
    ----------
    device : the run's device (its clock waits for the device's queued work).
    meter : a `meters` meter, or None (no memory measured).
    tracer : a `memory.AllocationTracer` (``--memory trace``), or None.
    """

    def __init__(self, device: torch.device, meter=None, tracer=None):
        self.clock = time.perf_counter  # what every region reads (a test may put a clock of its own here)
        self.sync = (
            (lambda: torch.cuda.synchronize(device))
            if device.type == "cuda"
            else torch.mps.synchronize
            if device.type == "mps"
            else None
        )
        self.meter = meter
        self.tracer = tracer if tracer is not None and tracer.enabled else None
        self.parts: dict[tuple[Owner, str], float] = defaultdict(float)  # seconds, since the observer began
        self.counts: Counter = Counter()  # measurement work done, by instrument (calls)
        self.references: dict[str, object] = {}  # owner label -> the reference cache it is compared with
        self.kv: dict[str, KVRecord] = defaultdict(KVRecord)
        self.rebuilt: Counter = Counter()  # owner label -> token-layers rebuilt or replayed
        self.tallies: dict[str, Counter] = defaultdict(Counter)  # owner label -> counted seams (`TALLIED`)
        self.keep_handed: set[int] = set()  # ids of layers whose candidates' positions a snapshot needs
        self.handed: dict[int, torch.Tensor] = {}
        self._stack: list[list] = []  # [owner, op, started, meter token, trace scope, memory owner]
        self._cross = ledger.CrossCheck(meter.ledger) if hasattr(meter, "ledger") else None
        self._unattributed_start = self._unattributed_now() if self._cross is not None else {}

    # --- clocks and regions ------------------------------------------------------------------------------------
    def now(self) -> float:
        """The clock, after the device's queued work."""
        if self.sync is not None:
            self.sync()
        return self.clock()

    def region(self, owner: Owner, op: str, memory: Owner | None = None) -> "_Region":
        """`with observer.region(owner, op):` the block is `owner`'s work, op `op`; its allocations are `memory`'s
        (default: `owner`'s)."""
        return _Region(self, owner, op, memory)

    def op(self, op: str) -> "_Region":
        """A nested region of the current owner's work, op `op` (a seam inside a strategy's update)."""
        top = self._stack[-1] if self._stack else None
        return _Region(self, top[0] if top else ENGINE, op, top[5] if top else None)

    def _enter(self, owner: Owner, op: str, memory: Owner | None = None):
        now = self.now()
        stack = self._stack
        if stack:
            top = stack[-1]
            self.parts[top[0], top[1]] += now - top[2]
        token = scope = None
        memory = memory or owner
        if self.meter is not None or self.tracer is not None:
            if self.meter is not None:
                token = self.meter.enter(memory.label)
            if self.tracer is not None:
                scope = self.tracer.scope(memory)
                scope.__enter__()
            start = self.now()
            self.parts[instrument(self._memory_part()), "meter"] += start - now
            now = start
        stack.append([owner, op, now, token, scope, memory])
        observers = getattr(_ACTIVE, "observers", None)
        if observers is None:
            observers = _ACTIVE.observers = []
        observers.append(self)

    def _leave(self):
        now = self.now()
        owner, op, started, token, scope, _ = self._stack.pop()
        self.parts[owner, op] += now - started
        if self.meter is not None or self.tracer is not None:
            if scope is not None:
                scope.__exit__(None, None, None)
            if self.meter is not None:
                self.meter.leave(token)
            end = self.now()
            self.parts[instrument(self._memory_part()), "meter"] += end - now
            now = end
        if self._stack:
            self._stack[-1][2] = now
        _ACTIVE.observers.pop()

    def _memory_part(self) -> str:
        return "trace" if self.tracer is not None else "allocator"

    def mark(self) -> dict:
        """The parts so far (`since` gives what was added after)."""
        return dict(self.parts)

    def since(self, mark: dict) -> dict[tuple[Owner, str], float]:
        return {key: s - mark.get(key, 0.0) for key, s in self.parts.items() if s != mark.get(key, 0.0)}

    def charge(self, key: tuple[Owner, str], to: tuple[Owner, str], seconds: float):
        """Move `seconds` of part `key` to part `to` (the shared pass's time charged to its rows)."""
        self.parts[key] -= seconds
        self.parts[to] += seconds

    # --- memory ------------------------------------------------------------------------------------------------
    def register(self, owner: Owner):
        """`owner`'s work gets bytes of its own in the meter."""
        if self.meter is not None:
            self.meter.register(owner.label)

    def held(self, owner: Owner) -> int | None:
        if self.meter is None:
            return None
        with self.region(instrument("allocator"), "read"):
            self.counts["allocator"] += 1
            return self.meter.held(owner.label)

    def outside(self, owner: Owner) -> int | None:
        """The owner's live bytes outside torch (numpy's data, Python's objects), where the meter reads them."""
        if self.meter is None:
            return None
        with self.region(instrument("allocator"), "read"):
            return self.meter.outside(owner.label)

    def count_unattributed_from_now(self):
        """What no owner's work holds is counted from here on (the engine, once built: the model's blocks were there
        before it)."""
        if self._cross is not None:
            self._cross.reset()
            self._unattributed_start = self._unattributed_now()

    def _unattributed_now(self, forwards: int = 0) -> dict[str, int]:
        """The ledger's counts of bytes no run's owner holds, now (outside every region, the measurement's own
        work), and the process's memory the ledger does not explain (`ledger.CrossCheck`: counted from its reset,
        its floor raised for `forwards` lanes' forwards so far)."""
        book = self.meter.ledger
        return {
            "outside_regions": book.unattributed(),
            "measurement": ledger.measurement_bytes(),
            **self._cross.parts(forwards),
        }

    def unattributed(self, forwards: int = 0) -> dict | None:
        """What no owner's work holds, since this observer began (process-wide, so another run's blocks outside
        its regions would show here too): blocks allocated outside every region (torch's and numpy's: code outside
        every region), the measurement's own work outside an engine, and the process's memory the ledger cannot
        explain (`ledger.CrossCheck`: the C allocator's bytes no hook saw, anonymous memory outside it, writable
        shared mappings; `forwards`: the lanes' forwards so far, whose records raise its floor); None without a
        meter that can read them."""
        if self._cross is None:
            return None
        with self.region(instrument("allocator"), "read"):
            now = self._unattributed_now(forwards)
        parts = {k: max(0, now[k] - self._unattributed_start.get(k, 0)) for k in now}
        return {"bytes": sum(parts.values()), **parts}

    def peak(self, owner: Owner) -> int | None:
        if self.meter is None:
            return None
        with self.region(instrument("allocator"), "read"):
            return self.meter.peak(owner.label)

    def reset_peaks(self, owners):
        if self.meter is not None:
            with self.region(instrument("allocator"), "read"):
                for owner in owners:
                    self.meter.reset(owner.label)

    def declared(self, cache) -> int:
        """Bytes of the distinct storages behind every tensor the cache lists (`state_tensors`): what the strategy
        says it holds, the formula's cross-check (a view counts its whole buffer, once)."""
        with self.region(instrument("storage"), "count"):
            self.counts["storage"] += 1
            return sum(storage_sizes(*cache.state_tensors()).values())

    # --- comparison --------------------------------------------------------------------------------------------
    def compare_with(self, owner: Owner, reference):
        """From now on, compare what `owner`'s cache hands attention with `reference`'s (None: stop)."""
        if reference is None:
            self.references.pop(owner.label, None)
        else:
            self.references[owner.label] = reference

    def compares(self, owner: Owner) -> bool:
        return owner.label in self.references

    def compare(self, owner: Owner, j: int, layer, keys: torch.Tensor, values: torch.Tensor):
        """Layer `j` of `owner`'s cache handed attention `keys`/`values`; the reference's layer `j` has processed
        the same step.  A sliding layer is compared by what it keeps (its window), as the reference's.  Shapes
        must match: a global layer that hands attention fewer or more tokens is not equal, whatever its values."""
        reference = self.references.get(owner.label)
        if reference is None:
            return
        ref = reference.layers[j]
        if ref.keys is None:
            return
        with self.region(instrument("compare"), "compare"):
            self.counts["compare"] += 1
            if getattr(layer, "is_sliding", False):
                keys, values = layer.keys, layer.values
            record = self.kv[owner.label]
            record.compared += 1
            record.layers.add(j)
            rk, rv = ref.keys, ref.values
            if rk.shape != keys.shape or rv.shape != values.shape:
                record.equal = False
                record.shape_mismatches += 1
            elif not (torch.equal(keys, rk) and torch.equal(values, rv)):
                record.equal = False
                record.max_dk = max(record.max_dk, float((keys.float() - rk.float()).abs().max()))
                record.max_dv = max(record.max_dv, float((values.float() - rv.float()).abs().max()))

    def kv_report(self, owner: Owner) -> dict:
        return self.kv[owner.label].report() if owner.label in self.kv else KVRecord().report()

    def count_rebuilt(self, owner: Owner, tokens: int):
        self.rebuilt[owner.label] += tokens
        if owner.label in self.references:
            self.kv[owner.label].rebuilt += tokens

    # --- the end of a turn -------------------------------------------------------------------------------------
    def digest(self, cache) -> str:
        """A hash of the bits of every tensor a cache holds (its K/V, inputs, anchors, token ids, scores,
        positions): equal in two runs when they hold the same bits."""
        with self.region(instrument("digest"), "digest"):
            self.counts["digest"] += 1
            h = hashlib.sha256()
            for t in cache.state_tensors():
                if t is None:
                    h.update(b"-")
                    continue
                t = t.detach().contiguous().reshape(-1)
                h.update(f"{t.dtype}{t.numel()}".encode())
                if t.numel():  # the tensor's own bytes, read in place (no copy of a store that may be 100 MiB)
                    h.update(t.view(torch.uint8).cpu().numpy())
            return h.hexdigest()[:16]

    def close(self):
        if self.meter is not None:
            self.meter.close()
        if self._cross is not None:
            self._cross.close()


class _Region:
    __slots__ = ("observer", "owner", "op", "memory")

    def __init__(self, observer: Observer, owner: Owner, op: str, memory: Owner | None):
        self.observer, self.owner, self.op, self.memory = observer, owner, op, memory

    def __enter__(self):
        self.observer._enter(self.owner, self.op, self.memory)
        return self

    def __exit__(self, *exc):
        self.observer._leave()
        return False


def storage_sizes(*tensors: torch.Tensor | None) -> dict[int, int]:
    """Address -> bytes of the distinct storages behind `tensors` (a view counts its whole buffer, once)."""
    out = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            out.setdefault(s.data_ptr(), s.nbytes())
    return out


# --- seams: the ops inside a strategy's update, timed from outside ----------------------------------------------
# method name -> the op it is timed as (None: the object's own `rebuild_op`, "recompute" or "replay").  A method
# that rebuilds K/V counts its tokens: `rebuild_old(end, capacity)` rebuilds tokens 0..end-1 of one layer,
# `rebuild_all(end)` tokens 0..end-1 of every layer it returns.
SEAMS = {
    "rebuild_old": None,
    "carry": "replay",
    "rebuild_all": "replay",
    "score": "scoring",
    "replay_layer": "replay",
    "_call": "replay",
    "_check_rows": None,
}
# Seams counted (per owner, `Observer.tallies`): a replay's decoder-layer passes and its layer calls.
TALLIED = {"replay_layer": "layer passes", "_call": "layer calls"}
# Seams that are the measurement's, not the strategy's: a replay's one-time check that rows in one call give the
# bits of separate calls runs as that instrument's work (its time and its blocks are no lane's).
CHECKS = {"_check_rows": "rows check"}
_OBSERVED: dict[type, type] = {}


def _seam(name: str, base: type):
    """`base`'s method `name`, timed as its op inside the current region (looked up at each call, so the class's
    own method is what runs, whatever replaced it since)."""

    def observed(self, *args, **kwargs):
        method = getattr(base, name)
        found = current()
        if found is None:
            return method(self, *args, **kwargs)
        observer, owner, _ = found
        if name in CHECKS:
            with observer.region(instrument(CHECKS[name]), "check"):
                return method(self, *args, **kwargs)
        if name in TALLIED:
            observer.tallies[owner.label][TALLIED[name]] += 1
        with observer.op(SEAMS[name] or self.rebuild_op):
            out = method(self, *args, **kwargs)
        if name == "rebuild_old":
            observer.count_rebuilt(owner, args[0])
        elif name == "rebuild_all":
            observer.count_rebuilt(owner, args[0] * len(out))
        elif name == "score" and id(self) in observer.keep_handed:
            observer.handed[id(self)] = args[0].positions
        return out

    observed.__name__ = name
    observed.__doc__ = getattr(base, name).__doc__
    return observed


def _observed_class(cls: type) -> type:
    if cls not in _OBSERVED:
        methods = {name: _seam(name, cls) for name in SEAMS if callable(getattr(cls, name, None))}
        _OBSERVED[cls] = type(cls.__name__, (cls,), {**methods, "__module__": cls.__module__, "__observed__": True})
    return _OBSERVED[cls]


def watch(cache):
    """Put observed subclasses in place of the classes of the cache's layers and of every object the cache holds
    that has a seam, and of those such an object holds (AnchorKV's store's replayer): the same objects,
    whose seams time (and count) themselves inside a region.  A fork (`copy.deepcopy`) keeps the classes.  Returns
    the cache."""

    def observable(obj) -> bool:
        cls = type(obj)
        return (
            not isinstance(obj, (Strategy, torch.Tensor, type, torch.nn.Module))
            and not getattr(cls, "__observed__", False)
            and any(callable(getattr(cls, name, None)) for name in SEAMS)
        )

    held = [*cache.layers, *vars(cache).values()]
    for obj in held + [
        inner
        for obj in held
        if not isinstance(obj, (torch.Tensor, torch.nn.Module, type))
        for inner in getattr(obj, "__dict__", {}).values()
    ]:
        if observable(obj):
            obj.__class__ = _observed_class(type(obj))
    return cache
