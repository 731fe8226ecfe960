"""Memory with nowhere to hide: what a lane's own code allocates counts as that lane's wherever it comes from
(numpy's data, Python's buffers: a list's array of items; a tensor made on a thread it started), and what no lane's
work holds (shared memory, the measurement's own) is reported as unattributed, never as nothing; there is no way to
work for nobody.  (tests/measure/test_hiding_ways.py: fifteen more ways, each with the mechanism that catches it.)

Each strategy below is a plain window whose score() also keeps a copy of the candidates' keys somewhere the
allocator's ledger did not see before this change: the test records the copies' own sizes (what it hid), and the
run's figures must show at least that much, where the plain window beside it shows none of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from kvdirect_app.app.ui.scoreboard import _outside, scoreboard_html
from kvdirect_app.app.ui.session import Session
from kvdirect_app.engine.runner import Engine
from kvdirect_app.measure import ledger, memory
from kvdirect_app.strategies import Strategy, parse_specs
from kvdirect_app.strategies.window import Window

from ..conftest import tiny

pytestmark = pytest.mark.check
TURNS = ["Tell me about caches.", "Why do keys need positions?"]
PLAIN = "window:budget=4"


def _hider(name: str, keep):
    """A window registered as `name` whose score() hands the step's keys to `keep(strategy, keys)`, which returns the
    bytes it hid (summed on the class)."""

    def score(self, step):
        type(self).hidden += keep(self, step.keys)
        return Window.score(self, step)

    return dataclass(type(f"Hider_{name}", (Window,), {"name": name, "hidden": 0, "score": score}))


def _numpy(self, keys):
    self.kept = getattr(self, "kept", []) + [keys.numpy().copy()]
    return self.kept[-1].nbytes


def _list(self, keys):
    self.kept = getattr(self, "kept", []) + [keys.tolist()]
    return keys.numel() * 8  # the lists' arrays of items: 8 bytes a value (the floats themselves on top, uncounted)


def _thread(self, keys):
    out = []
    worker = threading.Thread(target=lambda: out.append(keys.clone()))
    worker.start()
    worker.join()
    self.kept = getattr(self, "kept", []) + out
    return out[0].untyped_storage().nbytes()


def _shared(self, keys):
    self.kept = getattr(self, "kept", []) + [keys.clone().share_memory_()]
    return self.kept[-1].untyped_storage().nbytes()


def _owner_zero(self, keys):  # the one way left to name no one: owner 0, which is counted as unattributed
    with ledger.load().working_for(ledger.UNATTRIBUTED):
        self.kept = getattr(self, "kept", []) + [keys.clone()]
    return self.kept[-1].untyped_storage().nbytes()


def _harness(self, keys):  # the measurement's own scope, used by a strategy: counted as the measurement's
    with memory.harness():
        self.kept = getattr(self, "kept", []) + [keys.clone()]
    return self.kept[-1].untyped_storage().nbytes()


@pytest.fixture
def hiders():
    made = {}

    def make(name, keep):
        made[name] = _hider(f"test_hide_{name}", keep)
        return made[name]

    yield make
    for cls in made.values():
        Strategy.registry.pop(cls.name, None)


def _run(spec: str) -> tuple[dict, dict, Session]:
    """The run on a thread of its own, as the app runs its engine (numpy keeps its allocation handler per Python
    context: a new thread starts with numpy's own, so the ledger must put its handler in place where work runs)."""
    engine = Engine(tiny("tiny-llama"), parse_specs(f"full,{PLAIN},{spec}"), max_new_tokens=6, threads=1, twins=False)
    session = Session()

    def drive():
        for event in engine.run(TURNS):
            session.apply(event)

    worker = threading.Thread(target=drive)
    worker.start()
    worker.join()
    return session.result["strategies"], session.result["unattributed_bytes"], session


@pytest.mark.parametrize("way, keep", [("numpy", _numpy), ("list", _list)])
def test_a_copy_kept_as_numpy_or_as_a_list_is_held_outside_torch_by_the_lane(way, keep, hiders):
    """Mutations it catches: numpy's handler never put in place (`kv_numpy_install` not called: the numpy copy's bytes
    go unseen by the lane); Python's hooks not installed (`kv_python_install` skipped: the list's do)."""
    cls = hiders(way, keep)
    lanes, unattributed, session = _run(f"{cls.name}:budget=4")
    mine, plain = lanes[f"{cls.name}:budget=4"]["state_bytes"], lanes[PLAIN]["state_bytes"]
    assert cls.hidden > 10_000
    assert mine["outside_torch"]["held"] - plain["outside_torch"]["held"] >= cls.hidden
    assert plain["outside_torch"]["held"] < cls.hidden / 4  # the plain window's Python objects: a few KB
    assert mine["formula_matches_measurement"]  # its tensors are what its formula says: the rest is beside them
    board = scoreboard_html(session)
    row = next(r for r in board.split("<tr")[1:] if f'title="{cls.name}:budget=4"' in r)
    assert "outside torch" in row and "kvd-outside" in row


def test_a_pane_in_its_first_turn_weighs_its_outside_bytes_against_its_peak():
    """Before its first turn ends a pane has no held figure: its bytes outside torch are weighed against its peak so
    far, so the few KB a process's first calls cache stay off the board while a copy of the state's size shows.
    Mutation it catches: the old rule (no held figure: always written out) fails the first assertion."""
    first_turn = {"between": None, "peak": 1_700_000}
    assert _outside({**first_turn, "outside": 5_000}) == ""
    assert "kvd-outside" in _outside({**first_turn, "outside": 400_000})
    assert "kvd-outside" in _outside({"between": 20_000, "peak": 1_700_000, "outside": 5_000})  # held, then peak
    assert "kvd-outside" in _outside({"between": None, "peak": None, "outside": 5_000})  # nothing to weigh it by


def test_a_tensor_made_on_a_thread_the_strategy_started_is_the_lanes(hiders):
    """A thread started inside a lane's work works for that lane: its clone is the lane's, held above the formula.
    Mutation it catches: threads not inheriting their starter's owner (`ledger._inherit_owners` a no-op: the clone
    is no one's)."""
    cls = hiders("thread", _thread)
    lanes, unattributed, session = _run(f"{cls.name}:budget=4")
    mine = lanes[f"{cls.name}:budget=4"]["state_bytes"]
    assert cls.hidden > 10_000
    assert mine["formula_matches_measurement"] is False
    assert mine["persistent_peak"] - mine["formula_persistent_peak"] >= cls.hidden
    assert unattributed["outside_regions"] == 0, unattributed


@pytest.mark.parametrize(
    "way, keep, part",
    [
        ("shared", _shared, "shared_memory"),
        ("owner0", _owner_zero, "outside_regions"),
        ("harness", _harness, "measurement"),
    ],
)
def test_what_no_lane_holds_is_reported_as_unattributed(way, keep, part, hiders):
    """A clone moved to shared memory, one made while naming owner 0 or inside the measurement's scope: no lane
    holds them, and the run says so (`unattributed_bytes`, the board's row).  Mutations it catches: torch's blocks
    of owner 0 not recorded (owner 0's clones go unseen); the process's shared mappings not read
    (`CrossCheck._shared_mappings` returning 0)."""
    cls = hiders(way, keep)
    lanes, unattributed, session = _run(f"{cls.name}:budget=4")
    assert cls.hidden > 10_000
    assert unattributed[part] >= cls.hidden and unattributed["bytes"] >= cls.hidden, unattributed
    assert unattributed["peak"] >= cls.hidden
    board = scoreboard_html(session)
    row = next(r for r in board.split("<tr")[1:] if "kvd-unattributed-row" in r)
    assert "unattributed" in row and "kvd-bad" in row


def test_a_clean_run_leaves_nothing_unattributed_and_the_board_says_0():
    """The run's own work is all in regions: a clean run (every instrument on) ends with nothing unattributed, and
    the board's row says 0 B rather than nothing."""
    lanes, unattributed, session = _run("h2o:budget=4,kvdirect:budget=2,anchorkv:spacing=2:budget=2")
    assert unattributed["bytes"] == 0, unattributed
    row = next(r for r in scoreboard_html(session).split("<tr")[1:] if "kvd-unattributed-row" in r)
    assert "0 B" in row and "kvd-bad" not in row


def test_there_is_no_public_way_to_work_for_nobody():
    assert not hasattr(ledger, "nobody")
    assert ledger.UNATTRIBUTED == 0
