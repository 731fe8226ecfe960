"""The instruments observe the lanes from outside: every part of a step is timed where it runs, each lane's bytes
are the allocator's, a strategy defined outside the package is measured as the package's own, a hidden copy shows,
and with the instruments off the engine does no measurement work.

The time checks run the engine on a clock of the test's own (`Observer.clock`) that stands still unless the test
moves it: a "delay" injected into one part of a step moves it by a known amount inside that part, so every figure
is exactly the delays that landed in it.  The delay must show in that part's figure and in no other, nor in the
unattributed rest; a part whose clock were removed, or that ran outside its region, would hand its delay to
whatever region was around it (or to the rest), and its case fails.
"""

import json
import time
from collections import Counter
from dataclasses import dataclass

import psutil
import pytest
import torch

from kvdirect_app.app.ui.scoreboard import scoreboard_html
from kvdirect_app.app.ui.session import Session
from kvdirect_app.engine import lockstep, turn_steps
from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.engine.summary import Report
from kvdirect_app.kernels.invariant import Kernels
from kvdirect_app.kernels.replay import KVProjector, LayerReplayer
from kvdirect_app.measure import observe
from kvdirect_app.measure.memory import AllocationTracer
from kvdirect_app.measure.meters import LedgerMeter
from kvdirect_app.measure.observe import Observer, current
from kvdirect_app.models.loading import load_model
from kvdirect_app.plain.text import ReplyText
from kvdirect_app.strategies import Strategy, StrategyCache, parse_specs
from kvdirect_app.strategies.anchorkv import AnchorKV, AnchorStore
from kvdirect_app.strategies.base import FullLayer
from kvdirect_app.strategies.full import Full
from kvdirect_app.strategies.h2o import H2O
from kvdirect_app.strategies.kvdirect import KVDirect, ResidualLayer
from kvdirect_app.strategies.scored import ScoredLayer
from kvdirect_app.strategies.window import Window

from ..conftest import tiny

TURNS = ["Tell me about caches.", "Why do keys need positions?"]
KVD, ANCHOR, H2O_, WINDOW = (
    "kvdirect:budget=4",
    "anchorkv:spacing=2:budget=3:rebuild=step",
    "h2o:budget=6",
    "window:budget=4",
)
SPECS = f"full,{KVD},{ANCHOR},{H2O_},{WINDOW}"
DELAY = 0.05


class StillClock:
    """A clock that stands still unless a test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _inside(kind=None, label=None, op=None):
    """Whether this thread is in a region of that kind, owner label and op (None: any)."""

    def test() -> bool:
        found = current()
        if found is None:
            return False
        _, owner, region_op = found
        return (
            (kind is None or owner.kind == kind)
            and (label is None or owner.label == label)
            and (op is None or region_op == op)
        )

    return test


def _always() -> bool:
    return True


def _delay(monkeypatch, target, name: str, clock: StillClock, when=_always) -> list:
    """`target.name` replaced by the same call that first moves the clock by DELAY when `when()`; returns the list of
    delays injected (one entry a call)."""
    original, calls = getattr(target, name), []

    def delayed(*args, **kwargs):
        if when():
            clock.now += DELAY
            calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, delayed)
    return calls


def _lane(label):
    return lambda owner, op: owner.kind == "lane" and owner.label == label


def _owned(kind, label=None, op=None):
    return lambda owner, o: owner.kind == kind and (label is None or owner.label == label) and (op is None or o == op)


# case id -> (memory mode, what to delay (monkeypatch, engine, clock) -> calls, the parts the delay must land in
# (owner, op) -> bool, the step figure it must show in: ("lane", label), ("measurement", instrument), ("engine", op),
# ("shared",), or None for a part that works outside the steps)
CASES = {
    "a lane's own attention call (a prompt's)": (
        "auto",
        lambda mp, e, c: _delay(mp, Kernels, "attention", c, _inside(label="full", op="attention")),
        lambda o, op: _lane("full")(o, op) and op == "attention",
        None,  # a prompt's: the lane's time to the first token, no decode step's
    ),
    "the lanes' attention in one call (a decode step's)": (
        "auto",
        lambda mp, e, c: _delay(mp, Kernels, "attention_lanes", c),
        lambda o, op: o.kind in ("lane", "twin") and op == "attention",
        ("lanes",),
    ),
    "a lane's cache update": (
        "auto",
        lambda mp, e, c: _delay(mp, ScoredLayer, "update", c, _inside(label=WINDOW)),
        lambda o, op: _lane(WINDOW)(o, op) and op == "cache_update",
        ("lane", WINDOW),
    ),
    "a lane's scoring": (
        "auto",
        lambda mp, e, c: _delay(mp, H2O, "score", c, _inside(label=H2O_)),
        lambda o, op: _lane(H2O_)(o, op) and op == "scoring",
        ("lane", H2O_),
    ),
    "a lane's recompute": (
        "auto",
        lambda mp, e, c: _delay(mp, KVProjector, "project", c, _inside(label=KVD)),
        lambda o, op: _lane(KVD)(o, op) and op == "recompute",
        ("lane", KVD),
    ),
    "a lane's replay": (
        "auto",
        lambda mp, e, c: _delay(mp, LayerReplayer, "replay_layer", c, _inside(label=ANCHOR)),
        lambda o, op: _lane(ANCHOR)(o, op) and op == "replay",
        ("lane", ANCHOR),
    ),
    "a lane's setup": (
        "auto",
        lambda mp, e, c: _delay(mp, AnchorStore, "begin_step", c, _inside(label=ANCHOR)),
        lambda o, op: _lane(ANCHOR)(o, op) and op == "other",
        ("lane", ANCHOR),
    ),
    "the shared pass": (
        "auto",
        lambda mp, e, c: _delay(mp, e.model.model.norm, "forward", c, _inside(kind="shared")),
        lambda o, op: o.kind in ("lane", "twin") and op == "shared",
        ("shared",),
    ),
    "compare": (
        "auto",
        lambda mp, e, c: _delay(mp, torch, "equal", c, _inside(label="compare")),
        _owned("instrument", "compare"),
        ("measurement", "compare"),
    ),
    "agreement": (
        "auto",
        lambda mp, e, c: _delay(mp, turn_steps, "agree", c),
        _owned("instrument", "agreement"),
        ("measurement", "agreement"),
    ),
    "twins' fork": (
        "auto",
        lambda mp, e, c: _delay(mp, StrategyCache, "fork", c),
        _owned("twin", op="fork"),
        ("measurement", "twins"),
    ),
    "twins' rows": (
        "auto",
        lambda mp, e, c: _delay(mp, ScoredLayer, "update", c, _inside(kind="twin")),
        _owned("twin", op="cache_update"),
        ("measurement", "twins"),
    ),
    "snapshot": (
        "auto",
        lambda mp, e, c: _delay(mp, lockstep, "last_query_attention", c),
        _owned("instrument", "snapshot"),
        None,
    ),
    "digest": (
        "auto",
        lambda mp, e, c: _delay(mp, observe.hashlib, "sha256", c, _inside(label="digest")),
        _owned("instrument", "digest"),
        None,
    ),
    "the allocator's reads": (
        "auto",
        lambda mp, e, c: _delay(mp, LedgerMeter, "held", c),
        _owned("instrument", "allocator", "read"),
        ("measurement", "allocator"),
    ),
    "the storage count": (
        "auto",
        lambda mp, e, c: _delay(mp, observe, "storage_sizes", c),
        _owned("instrument", "storage"),
        ("measurement", "storage"),
    ),
    "rss": (
        "auto",
        lambda mp, e, c: _delay(mp, psutil.Process, "memory_info", c, _inside(label="rss")),
        _owned("instrument", "rss"),
        ("measurement", "rss"),
    ),
    "the trace": (
        "trace",
        lambda mp, e, c: _delay(mp, AllocationTracer, "_fold", c),
        _owned("instrument", "trace", "session"),
        ("measurement", "trace"),
    ),
    "choosing tokens": (
        "auto",
        lambda mp, e, c: _delay(mp, torch, "argmax", c, _inside(kind="engine", op="choose")),
        _owned("engine", op="choose"),
        ("engine", "choose"),
    ),
    "detokenising": (
        "auto",
        lambda mp, e, c: _delay(mp, ReplyText, "add", c),
        _owned("engine", op="detokenize"),
        ("engine", "detokenize"),
    ),
    "events": (
        "auto",
        lambda mp, e, c: _delay(mp, Report, "lane_event", c),
        _owned("engine", op="events"),
        ("engine", "events"),
    ),
    "the logits' copy": (
        "auto",
        lambda mp, e, c: _delay(mp, torch.Tensor, "clone", c, _inside(kind="engine", op="logits")),
        _owned("engine", op="logits"),
        ("engine", "logits"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_delay_in_one_part_of_a_step_shows_in_that_part_and_no_other(case, monkeypatch):
    """Each part in turn: every lane op, the shared pass, each instrument, the engine's own work.  On the still
    clock, all the time there is is the injected delays: the parts they landed in must be exactly the expected
    one(s), holding all of it, and in every step the step's wall time must be that part's figure, every other
    figure 0, the unattributed rest 0.
    Mutations it catches (each applied once, each failed): the comparison run outside its instrument's region (its
    delay lands in the lane's cache update); the meter's reads outside their region (their delay in the rest);
    the shared pass charged to the lanes only (the twins' share lost: the rows' shares do not add up to it)."""
    memory, inject, expected, where = CASES[case]
    engine = Engine(tiny("tiny-llama"), parse_specs(SPECS), max_new_tokens=6, threads=1, memory=memory)
    clock = StillClock()
    engine.observer.clock = clock
    engine.observer.parts.clear()  # building the lanes ran on the real clock
    calls = inject(monkeypatch, engine, clock)
    events = list(engine.run(TURNS))
    assert calls, "the delay never fired: the case does not reach its part"
    injected = DELAY * len(calls)
    landed = {key: s for key, s in engine.observer.parts.items() if abs(s) > 1e-12}
    assert sum(s for (owner, op), s in landed.items() if expected(owner, op)) == pytest.approx(injected)
    assert not [key for key in landed if not expected(*key)], landed
    steps = [e for e in events if e["type"] == "step"]
    for step in steps:
        assert step["unattributed_ms"] == pytest.approx(0.0, abs=1e-6), step
        figures = {
            **{("lane", k): v for k, v in step["lanes_ms"].items()},
            **{("measurement", k): v for k, v in step["measurement_ms"].items()},
            **{("engine", k): v for k, v in step["engine_ms"].items()},
        }
        if where == ("lanes",):  # one call for every row, charged to each by the keys it reads: all of it, no more
            shares = sum(step["lanes_ms"].values()) + step["measurement_ms"].get("twins", 0.0)
            assert shares == pytest.approx(step["step_ms"]), step
            assert not step["engine_ms"] and set(step["measurement_ms"]) <= {"twins"}, step
            continue
        if where == ("shared",):  # charged by rows: the lanes' shares and the twins' add up to it
            shares = sum(step["lanes_ms"].values()) + step["measurement_ms"].get("twins", 0.0)
            assert shares == pytest.approx(step["shared_ms"]) == pytest.approx(step["step_ms"]), step
            assert not step["engine_ms"] and set(step["measurement_ms"]) <= {"twins"}, step
            continue
        assert figures.get(where, 0.0) == pytest.approx(step["step_ms"]), (where, step)
        others = {k: v for k, v in figures.items() if k != where and abs(v) > 1e-9}
        assert not others, (step, others)
    shown = sum(s["shared_ms"] if where == ("shared",) else s["step_ms"] for s in steps)
    assert (shown > 0) == (where is not None), "the delay showed in the steps" if where is None else "it never did"
    if where == ("lanes",):  # each lane's share by the keys it reads: the full cache's K/V, KV-Direct's all of them
        lanes = {owner.label: s for (owner, op), s in landed.items() if owner.kind == "lane"}
        assert lanes["full"] == pytest.approx(lanes[KVD]) and lanes["full"] > lanes[WINDOW] > 0, lanes


def test_a_delay_outside_every_region_shows_as_the_steps_unattributed_time_and_nowhere_else(monkeypatch):
    """The rest no clock covered is a figure of its own, not whatever is left to make the parts add up: a delay in
    the engine's step loop outside every region (before each pass enters its regions) lands in no part, and each
    step's unattributed time is exactly the delays of that step.  Mutation: unattributed forced to 0 (the step's
    parts then fall short of its wall time, and this fails)."""
    from kvdirect_app.engine.forwards import Forwards

    engine = Engine(tiny("tiny-llama"), parse_specs(SPECS), max_new_tokens=6, threads=1)
    clock = StillClock()
    engine.observer.clock = clock
    engine.observer.parts.clear()
    calls = _delay(monkeypatch, Forwards, "run", clock, lambda: current() is None)
    steps = [e for e in engine.run(TURNS) if e["type"] == "step"]
    assert calls and steps
    assert not {key: s for key, s in engine.observer.parts.items() if abs(s) > 1e-12}
    for step in steps:  # one pass a step (ms)
        assert step["unattributed_ms"] == pytest.approx(1e3 * DELAY) == pytest.approx(step["step_ms"])
        assert not any(step["lanes_ms"].values()) and not step["measurement_ms"] and not step["engine_ms"]


def test_the_observer_reads_the_real_clock():
    """The same part on the real clock: a lane's attention slowed by a sleep shows at least the sleep in that lane's
    attention figure, and the unattributed rest does not take it."""
    engine = Engine(tiny("tiny-llama"), parse_specs(f"full,{KVD}"), max_new_tokens=3, threads=1, twins=False)
    slept = []
    original = Kernels.attention_lanes

    def slow(self, *args, **kwargs):
        time.sleep(DELAY)
        slept.append(1)
        return original(self, *args, **kwargs)

    Kernels.attention_lanes = slow
    try:
        events = list(engine.run(TURNS[:1]))
    finally:
        Kernels.attention_lanes = original
    # Both lanes hand attention every token's K/V: each is charged half of every call.
    assert slept and engine.observer.parts[engine.lanes[0].owner, "attention"] >= DELAY * len(slept) / 2
    steps = [e for e in events if e["type"] == "step"]
    assert all(e["unattributed_ms"] < 1e3 * DELAY for e in steps)


# --- no measurement work with the instruments off -------------------------------------------------------------------


def _spied(monkeypatch) -> Counter:
    """Every piece of measurement work, counted where it is done: regions of an instrument or a twin, the storage
    count, the meters, the trace, the RSS read, forks, agreement, snapshots."""
    seen = Counter()

    def spy(target, name, key=None):
        original = getattr(target, name)

        def counted(*args, **kwargs):
            seen[key or name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(target, name, counted)

    enter = Observer._enter

    def entering(self, owner, op, memory=None):
        if owner.kind in ("instrument", "twin"):
            seen[f"region:{owner.label if owner.kind == 'instrument' else 'twin'}"] += 1
        return enter(self, owner, op, memory)

    monkeypatch.setattr(Observer, "_enter", entering)
    spy(observe, "storage_sizes")
    for name in ("register", "enter", "held", "peak", "reset"):
        spy(LedgerMeter, name, f"meter.{name}")
    spy(AllocationTracer, "start", "trace")
    spy(psutil.Process, "memory_info", "rss")
    spy(StrategyCache, "fork")
    spy(turn_steps, "agree")
    spy(lockstep, "last_query_attention", "snapshot")
    return seen


def test_with_the_instruments_off_the_engine_does_no_measurement_work(monkeypatch):
    """Instruments off: no region of an instrument or a twin, no storage count, no meter, trace, RSS read, fork,
    agreement or snapshot ran, and the results say so; on (the default), each of them ran, so the spies see them.
    Mutation it catches: byte bookkeeping back inside a strategy (a `storage_sizes` call in a cache layer's update,
    as `MeasuredLayer` made) counts with the instruments off."""
    loaded = tiny("tiny-llama")
    seen = _spied(monkeypatch)
    engine = Engine(loaded, parse_specs(SPECS), max_new_tokens=8, threads=1, instruments=False)
    off = run_to_end(engine, TURNS)
    assert dict(seen) == {} and not engine.observer.counts
    assert off["instruments"] == {
        "memory": "none",
        "compare": False,
        "twins": False,
        "agreement": False,
        "snapshots": False,
        "digests": False,
        "rss": False,
    }
    assert off["steps"]["measurement_ms_mean"] == 0.0 and off["steps"]["measurement_by_instrument_ms_mean"] == {}
    for spec, r in off["strategies"].items():
        assert r["kv_digest"] is None and r["state_bytes"]["peak"] is None, spec
        assert r["teacher_forced_steps"] in (None, 0), spec
    assert off["strategies"][KVD]["kv_exact"] is None  # nothing compared, nothing claimed

    on = run_to_end(Engine(loaded, parse_specs(SPECS), max_new_tokens=8, threads=1), TURNS)
    expected = {
        "region:compare",
        "region:agreement",
        "region:twin",
        "region:snapshot",
        "region:digest",
        "region:allocator",
        "region:storage",
        "region:rss",
        "storage_sizes",
        "meter.register",
        "meter.enter",
        "meter.held",
        "meter.peak",
        "meter.reset",
        "rss",
        "fork",
        "agree",
        "snapshot",
    }
    assert expected <= set(seen), expected - set(seen)
    assert "trace" not in seen  # the default memory instrument is the allocator's ledger, not the trace
    assert on["strategies"][KVD]["kv_exact"] is True
    # The same tokens either way: the instruments only observe.
    assert all(on["strategies"][s]["token_ids"] == off["strategies"][s]["token_ids"] for s in on["strategies"])


@pytest.mark.check
def test_the_cli_names_its_instruments_and_refuses_an_unknown_one(tmp_path, capsys):
    from kvdirect_app import bench

    out = tmp_path / "run.json"
    assert (
        bench.main(
            [
                "run",
                "--model",
                "tiny-llama",
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "3",
                "--threads",
                "1",
                "--strategies",
                "full,kvdirect:budget=2",
                "--no-instruments",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "memory instrument: none (formula only)" in printed and "measurement 0.0 (none)" in printed
    result = json.loads(out.read_text())
    assert not any(v for k, v in result["instruments"].items() if k != "memory")
    assert (
        bench.main(
            [
                "run",
                "--model",
                "tiny-llama",
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "3",
                "--threads",
                "1",
                "--strategies",
                "full,kvdirect:budget=2",
            ]
        )
        == 0
    )
    assert "memory instrument: allocator ledger (cpu)" in capsys.readouterr().out
    assert bench.main(["run", "--model", "tiny-llama", "--prompt", "Hi", "--memory", "ledger"]) == 2
    assert "memory: 'ledger' is not allowed; allowed: auto, allocator, trace, storage, none" in capsys.readouterr().err


# --- strategies defined outside the package ----------------------------------------------------------------------


def _swapping_layers(base: type, name: str, layer: type, copying: type) -> type:
    """A subclass of strategy `base`, registered as `name`, whose cache's `layer` layers are `copying` ones."""

    def build_cache(self, model):
        cache = base.build_cache(self, model)
        for each in cache.layers:
            if type(each) is layer:
                each.__class__ = copying
        return cache

    return dataclass(type(f"Leaky{base.__name__}", (base,), {"name": name, "build_cache": build_cache}))


@pytest.fixture
def outside():
    """Strategies a user would add (a subclass and a name), registered for the test only: a plain copy of the
    window, and, per strategy family, one that keeps a copy it does not list (in its score, its rebuild, its replay,
    its layers)."""

    @dataclass
    class MyWindow(Window):
        name = "test_my_window"

    @dataclass
    class LeakyWindow(Window):  # the reviewer's case: a copy of the candidates' keys kept in score()
        name = "test_leaky_window"

        def score(self, step):
            self.copy = step.keys.clone()
            return super().score(step)

    class CopyingResidualLayer(ResidualLayer):
        def rebuild_old(self, end, capacity):
            keys, values = super().rebuild_old(end, capacity)
            self.copy = keys.clone()
            return keys, values

    LeakyKVDirect = _swapping_layers(KVDirect, "test_leaky_kvdirect", ResidualLayer, CopyingResidualLayer)

    class CopyingStore(AnchorStore):
        def old_kv(self, layer, end, capacity):
            keys, values = super().old_kv(layer, end, capacity)
            self.copy = keys.clone()
            return keys, values

    @dataclass
    class LeakyAnchorKV(AnchorKV):
        name = "test_leaky_anchorkv"

        def build_cache(self, model):
            cache = super().build_cache(model)
            cache.store.__class__ = CopyingStore
            return cache

    class CopyingFullLayer(FullLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.copy = keys[..., -1:, :].clone()
            return keys, values

    LeakyFull = _swapping_layers(Full, "test_leaky_full", FullLayer, CopyingFullLayer)

    names = [cls.name for cls in (MyWindow, LeakyWindow, LeakyKVDirect, LeakyAnchorKV, LeakyFull)]
    try:
        yield names
    finally:
        for name in names:
            Strategy.registry.pop(name, None)


def test_a_strategy_defined_outside_the_package_is_measured_as_the_packages_own(outside):
    """A subclass with a name of its own and nothing else: the same tokens, bytes (measured, peak, formula) and
    latency ops as the window it copies: the observer finds its seams and its regions as it finds the package's."""
    result = run_to_end(
        Engine(tiny("tiny-llama"), parse_specs(f"full,{WINDOW},test_my_window:budget=4"), max_new_tokens=6, threads=1),
        TURNS,
    )
    mine, window = result["strategies"]["test_my_window:budget=4"], result["strategies"][WINDOW]
    assert mine["token_ids"] == window["token_ids"]
    for key in ("persistent_peak", "peak", "between_turns_peak", "formula_peak", "formula_matches_measurement"):
        assert mine["state_bytes"][key] == window["state_bytes"][key], key
    assert {k for k, v in mine["latency_ms"].items() if v} == {k for k, v in window["latency_ms"].items() if v}
    assert mine["latency_ms"]["decode_scoring_ms_mean"] > 0  # its scoring was timed as scoring


LEAKY = {
    "full": ("full", "test_leaky_full"),
    "kvdirect": (KVD, "test_leaky_kvdirect:budget=4"),
    "anchorkv": (ANCHOR, "test_leaky_anchorkv:spacing=2:budget=3:rebuild=step"),
    "eviction": (WINDOW, "test_leaky_window:budget=4"),
}


def _caught(loaded, clean: str, leaky: str, **options) -> tuple[dict, dict, Session]:
    engine = Engine(loaded, parse_specs(",".join(dict.fromkeys(["full", clean, leaky]))), threads=1, **options)
    session = Session()
    for event in engine.run(TURNS):
        session.apply(event)
    return session.result["strategies"][clean], session.result["strategies"][leaky], session


@pytest.mark.parametrize("family", list(LEAKY))
def test_a_hidden_copy_is_caught_by_the_default_run_in_every_strategy_family(family, outside):
    """Per family, a strategy that keeps a copy it does not list (in its layers, its rebuild, its replay, its
    score): the default run measures more than its formula and more than the clean strategy beside it, while the
    tensors it lists still agree with the formula; the pane says so (`holds ≠ its formula`), the clean one's does
    not.  Mutation it catches: the default memory figure taken from what the strategy lists (the storage count:
    `memory="storage"`), which equals the clean strategy's."""
    clean, leaky = LEAKY[family]
    c, lk, session = _caught(tiny("tiny-llama"), clean, leaky, max_new_tokens=6)
    assert lk["state_bytes"]["formula_matches_measurement"] is False and lk["state_bytes"]["mismatch_count"] > 0
    assert c["state_bytes"]["formula_matches_measurement"] is True
    assert lk["state_bytes"]["declared_mismatch_count"] == 0  # what it lists agrees: only the allocator sees it
    assert lk["state_bytes"]["persistent_peak"] > c["state_bytes"]["persistent_peak"]
    board = scoreboard_html(session)
    rows = {row.split("</td>")[0]: row for row in board.split("<tr>")[1:]}
    leaky_row = next(row for head, row in rows.items() if f'title="{leaky}"' in head)
    clean_row = (
        next(row for head, row in rows.items() if f'title="{clean}"' in head)
        if clean != "full"
        else next(row for head, row in rows.items() if 'title="full"' in head)
    )
    assert "holds ≠ its formula" in leaky_row and "holds ≠ its formula" not in clean_row


def test_the_reviewers_hidden_copy_on_smollm2(outside):
    """The reviewer's subclass (a window whose score() keeps a copy of the candidates' keys) on the real model,
    default run: its bytes above the plain window's and its formula check failing."""
    clean, leaky = LEAKY["eviction"]
    c, lk, _ = _caught(load_model("smollm2-135m"), clean, leaky, max_new_tokens=4, twins=False)
    assert lk["state_bytes"]["between_turns_peak"] > c["state_bytes"]["between_turns_peak"]
    assert lk["state_bytes"]["formula_matches_measurement"] is False
    assert c["state_bytes"]["formula_matches_measurement"] is True
