"""The engine's measuring instruments: what each one observes, when, and what it costs, apart from the lanes.

The engine runs lanes; the instruments observe them at fixed points of a step
and a turn, and their own time is never a lane's (nor the shared pass's):

* ``compare``: each K/V an exact strategy hands attention against what the
  full cache holds for the same step (`MeasuredLayer.compare`: this is what
  decides "bit-exact");
* ``twins``: a strategy's teacher-forced twin after its first divergence (its
  rows ride in the lanes' pass; their attention, cache work and 1/N share of
  the pass are the twins');
* ``agreement``: teacher-forced agreement, KL and max |dlogit| per step;
* ``snapshot``: the last prompt query's attention at every layer (a turn's);
* ``digest``: a hash of the bits each lane holds at the end of a turn;
* ``storage`` (the default memory instrument): after every forward, the
  distinct storages of the tensors each lane's cache holds, plus the
  transient buffers the strategy counts where it allocates them;
* ``trace`` (``--memory trace``): the allocator's every allocation and free,
  folded by owner (`memory.AllocationTracer`): the auditor of ``storage``
  (both are kept in that mode and held to each other);
* ``rss``: the process's resident bytes after each forward.

``Instruments.off()`` turns every one of them off: the engine then does no
measurement work at all (`COUNTS` says what ran; a test holds it to zero).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

MEMORY_MODES = ("storage", "trace", "none")
NAMES = ("compare", "twins", "agreement", "snapshot", "digest", "storage", "trace", "rss")

# Measurement work done in this process, by instrument (calls): what a test counts.
COUNTS: Counter = Counter()


@dataclass
class Instruments:
    memory: str = "storage"
    compare: bool = True
    twins: bool = True
    agreement: bool = True
    snapshots: bool = True
    digests: bool = True
    rss: bool = True
    seconds: dict = field(default_factory=lambda: dict.fromkeys(NAMES, 0.0))  # since the last `take()`

    @classmethod
    def off(cls) -> "Instruments":
        return cls(memory="none", compare=False, twins=False, agreement=False, snapshots=False, digests=False,
                   rss=False)

    @property
    def any(self) -> bool:
        return self.memory != "none" or self.compare or self.twins or self.snapshots or self.digests or self.rss

    def add(self, name: str, seconds: float, calls: int = 0):
        """`name`'s work took `seconds` (timed where it ran); `calls`: pieces of work to count, where the work
        itself does not count them."""
        self.seconds[name] += seconds
        COUNTS[name] += calls

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def take(self) -> dict[str, float]:
        """Milliseconds per instrument since the last call (then reset); only instruments that ran."""
        out = {name: 1e3 * s for name, s in self.seconds.items() if s}
        self.seconds = dict.fromkeys(NAMES, 0.0)
        return out

    def describe(self) -> dict:
        """For the run's JSON: which instruments ran."""
        return {"memory": self.memory, "compare": self.compare, "twins": self.twins, "agreement": self.agreement,
                "snapshots": self.snapshots, "digests": self.digests, "rss": self.rss}
