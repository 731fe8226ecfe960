"""The engine's measuring instruments: which ones run in a run (`Instruments`), and what each observes.

The engine runs lanes; the instruments observe them at fixed points of a step
and a turn, in regions of their own (`observe.py`), so their time is never a
lane's (nor the shared pass's) and their allocations their own (no lane's):

* ``compare``: each K/V an exact strategy hands attention against what the
  full cache holds for the same step (`Observer.compare`: this is what
  decides "bit-exact");
* ``twins``: a strategy's teacher-forced twin after its first divergence (its
  rows ride in the lanes' pass; their attention, cache work, fork and 1/N
  share of the pass are the twins');
* ``agreement``: teacher-forced agreement, KL and max |dlogit| per step;
* ``snapshot``: the last prompt query's attention at every layer (a turn's);
* ``digest``: a hash of the bits each lane holds at the end of a turn;
* memory (``memory``: the meter and its reads, "allocator"; the declared storage
  count, "storage"; ``--memory trace``'s sessions and scopes, "trace"):
  ``allocator`` (the default; `meters.py`) measures each lane's held bytes and
  peak by the allocator the tensors live in; ``trace`` traces every allocation
  and audits the meter; ``storage`` counts only what the strategy lists
  (declared, where no allocator can be read); beside each, the storage count
  is the formula's cross-check;
* ``rss``: the process's resident bytes after each forward.

``Instruments.off()`` turns every one of them off: the engine then does no
measurement work at all (the observer's `counts` say what ran; a test holds
them to zero).
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_MODES = ("auto", "allocator", "trace", "storage", "none")


@dataclass
class Instruments:
    memory: str = "auto"
    compare: bool = True
    twins: bool = True
    agreement: bool = True
    snapshots: bool = True
    digests: bool = True
    rss: bool = True

    @classmethod
    def off(cls) -> "Instruments":
        return cls(
            memory="none", compare=False, twins=False, agreement=False, snapshots=False, digests=False, rss=False
        )

    @property
    def any(self) -> bool:
        return self.memory != "none" or self.compare or self.twins or self.snapshots or self.digests or self.rss

    def describe(self) -> dict:
        """For the run's JSON: which instruments ran."""
        return {
            "memory": self.memory,
            "compare": self.compare,
            "twins": self.twins,
            "agreement": self.agreement,
            "snapshots": self.snapshots,
            "digests": self.digests,
            "rss": self.rss,
        }
