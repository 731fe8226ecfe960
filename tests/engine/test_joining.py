"""A pane that joins a conversation under way (`Engine.join`, `Engine.catch_up`) stands where it would stand had it
been there from the start, and nothing else is recomputed.

Run A has every lane from the first turn; run B starts with two of them, the others join after two turns (the
second one stopped after a few steps in both runs), and B's catch-up replays the earlier turns for the joining
lanes alone.  Every joined lane must then say the same tokens in every turn, hold the same bits (the digest of its
cache's tensors) and the same bytes as in A; the lanes already there must get no forward during the catch-up.
"""

from __future__ import annotations

import pytest

from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.prompts import InputError
from kvdirect_app.strategies import parse_specs

from ..runs import LOCKSTEP, tiny

TURNS = ("Tell me about caches.", "Why do keys need positions?", "And values?")
FIRST = ("window:budget=6", "kvdirect:budget=4")
STOP_AFTER = 3  # the second turn is stopped after this many steps (its lanes were still active)


def play(engine: Engine, turns, stop_turn: int | None = 1) -> list[dict]:
    events = []
    for k, text in enumerate(turns):
        gen = engine.turn(text)
        for event in gen:
            events.append(event)
            if k == stop_turn and event["type"] == "step" and event["index"] + 1 == STOP_AFTER:
                gen.close()
                break
    return events


def run_pair(family: str):
    loaded = tiny(family)
    specs = [s for s in LOCKSTEP if s != "full"]
    joining = [s for s in specs if s not in FIRST]
    a = Engine(loaded, parse_specs(",".join(specs)), max_new_tokens=8, memory="allocator", threads=1)
    play(a, TURNS)
    b = Engine(loaded, parse_specs(",".join(FIRST)), max_new_tokens=8, memory="allocator", threads=1)
    play(b, TURNS[:2])
    before = {lane.label: len(lane.forwards) for lane in b.all_lanes}
    join = b.join(parse_specs(",".join(joining)))
    caught = list(b.catch_up())
    after = {lane.label: len(lane.forwards) for lane in b.all_lanes if lane.label in before}
    play(b, TURNS[2:], stop_turn=None)
    return a, b, join, caught, before, after, joining


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_a_joined_pane_says_and_holds_what_it_would_have_from_the_start(family):
    a, b, join, caught, before, after, joining = run_pair(family)
    assert before == after  # the reference and the lanes already there: not one forward during the catch-up
    assert join["type"] == "join" and join["turns"] == 2 and len(join["added"]) == len(joining)
    assert b.show == [*FIRST_LABELS(b), *join["added"]]
    kinds = [e["type"] for e in caught]
    assert kinds.count("catch_up_turn") == 2 and kinds.count("catch_up_turn_end") == 2 and kinds[-1] == "caught_up"
    # The stopped second turn ends for the joining lanes after the same step.
    second = [e for e in caught if e["type"] == "catch_up_step" and e["turn"] == 1]
    assert len(second) == STOP_AFTER
    ra, rb = a.results()["strategies"], b.results()["strategies"]
    for label in join["added"]:
        x, y = ra[label], rb[label]
        assert y["turn_token_ids"] == x["turn_token_ids"], label
        assert y["turn_texts"] == x["turn_texts"], label
        assert y["kv_digest"] == x["kv_digest"], label  # the same bits in every tensor the cache holds
        assert [t["between_turns"] for t in y["turns"]] == [t["between_turns"] for t in x["turns"]], label
        assert y["state_bytes"]["formula_matches_measurement"], label
        assert y["joined_at_turn"] == 2 and x["joined_at_turn"] == 0
        # Agreement from the joining turn on only: the third turn's steps (8), where A counts every turn's.
        assert y["teacher_forced_steps"] <= 8 < x["teacher_forced_steps"], label
        last = x["turns"][2]["decode_ms_per_token"] is None  # (a reply of one token has no decode step)
        assert [t["decode_ms_per_token"] is None for t in y["turns"]] == [True, True, last], label
        if x["kv_exact"] is True:  # an exact lane joined is compared with the reference from the joining turn on
            assert y["kv_exact"] is True and y["layers_compared"] > 0, label
    for label in FIRST_LABELS(b):  # the lanes already there are as in A too
        assert rb[label]["turn_token_ids"] == ra[label]["turn_token_ids"]
        assert rb[label]["kv_digest"] == ra[label]["kv_digest"]


def FIRST_LABELS(engine: Engine) -> list[str]:
    return [s.label for s in parse_specs(",".join(FIRST))]


def test_a_pane_leaves_and_a_stopped_catch_up_takes_the_joining_panes_back():
    loaded = tiny("tiny-llama")
    engine = Engine(loaded, parse_specs("window:budget=6,h2o:budget=6"), max_new_tokens=4, memory="allocator")
    play(engine, TURNS[:2], stop_turn=None)
    assert engine.drop(["h2o:budget=6"])["strategies"] == ["window:budget=6"]
    assert [lane.label for lane in engine.lanes] == ["window:budget=6"]
    with pytest.raises(InputError, match="is not shown"):
        engine.drop(["h2o:budget=6"])
    engine.join(parse_specs("tova:budget=6,full"))
    assert engine.show == ["window:budget=6", "tova:budget=6", "full"]
    with pytest.raises(InputError, match="catch_up"):
        next(engine.turn("Next?"))
    with pytest.raises(InputError, match="listed twice"):
        engine.join(parse_specs("window:budget=6"))
    gen = engine.catch_up()
    next(gen)
    gen.close()  # a stop during the replay: the joining lane leaves again
    assert engine.show == ["window:budget=6", "full"] and [lane.label for lane in engine.lanes] == ["window:budget=6"]
    events = play(engine, TURNS[2:], stop_turn=None)  # and the conversation goes on
    assert events[-1]["type"] == "turn_end" and set(events[-1]["texts"]) == {"full", "window:budget=6"}


def test_a_solo_run_or_a_turn_with_a_question_refuses_a_join():
    loaded = tiny("tiny-llama")
    solo = Engine(loaded, parse_specs("window:budget=6"), max_new_tokens=2, compare=False)
    with pytest.raises(InputError, match="solo"):
        solo.join(parse_specs("h2o:budget=6"))
    engine = Engine(loaded, parse_specs("window:budget=6"), max_new_tokens=2)
    list(engine.turn("Context.", question=engine.prompter.encode("Q?", False)))
    with pytest.raises(InputError, match="only plain messages"):
        engine.join(parse_specs("h2o:budget=6"))
