"""A pane ticked after some turns joins the conversation: the page says before Send what the next Send replays,
the new pane alone replays the earlier turns (the others keep their state), and it ends where a run that had it
from the start ends; a pane unticked leaves with nothing replayed."""

from __future__ import annotations

import html
import re

import pytest

pytest.importorskip("gradio_client")

from kvdirect_app.app.ui.session import Session  # noqa: E402
from kvdirect_app.app.ui.settings import expand  # noqa: E402

from .test_app import _controls, _statuses, engine_result  # noqa: E402

TURNS = ["Hello.", "And then?", "Once more."]


def text(notice: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", notice))


def test_a_pane_added_after_two_turns_replays_them_alone_and_ends_as_from_the_start(app):
    demo, _ = app
    h = demo.kvd_handlers
    session = Session()
    first = ["full", "h2o"]
    for turn in TURNS[:2]:
        assert _statuses(demo, h.send(session, turn, **_controls(strategies=first)))[-1].startswith("Done")
    assert h.next_send(session, **_controls(strategies=first)) == ""  # nothing changed: nothing to say
    more = ["full", "kvdirect", "h2o", "snapkv"]
    notice = text(h.next_send(session, **_controls(strategies=more)))
    spec = lambda name: expand(name, 40, 2, "exact", "step")
    assert notice.startswith(f"Next Send adds {spec('kvdirect')}, {spec('snapkv')}, replaying the 2 earlier"), notice
    assert "not recomputed" in notice
    said = text(h.next_send(session, **_controls(strategies=more, budget=3)))
    assert said.startswith("Next Send rebuilds the conversation (strategies, ") or "budget" in said, said
    engine = session.engine.engine
    ref = engine.reference
    kept = {lane.label: len(lane.forwards) for lane in engine.all_lanes}
    statuses = _statuses(demo, h.send(session, TURNS[2], **_controls(strategies=more)))
    assert any(s.startswith("Adding pane(s): replaying earlier turn 1/2 for them alone") for s in statuses), statuses
    assert statuses[-1].startswith("Done: 3 turn(s); turn 3:"), statuses[-1]
    # The reference and h2o read turn 3 only: one prompt forward and their steps, nothing of turns 1-2 again.
    for label, before in kept.items():
        lane = next(x for x in engine.all_lanes if x.label == label)
        # (a forward for the prompt, one per token but the last, which is never fed)
        assert len(lane.forwards) - before == len(lane.tokens[2]), label
    assert session.engine.engine is engine and ref is engine.reference
    specs = ",".join(expand(n, 40, 2, "exact", "step") for n in more)
    want = engine_result("tiny-llama", specs, TURNS, 4)["strategies"]
    got = session.result["strategies"]
    for label in want:
        assert got[label]["turn_token_ids"] == want[label]["turn_token_ids"], label
        assert got[label]["kv_digest"] == want[label]["kv_digest"], label
    # The page shows every pane with all three replies, the new ones' among them.
    assert session.shown[:2] == ["full", "h2o:budget=40"] and set(session.shown) == set(want)
    for label in session.shown:
        assert len(session.lanes[label].replies) == 3, label
        assert [r.tokens for r in session.lanes[label].replies] == want[label]["turn_token_ids"], label
    assert h.next_send(session, **_controls(strategies=more)) == ""
    # A pane unticked leaves: nothing is replayed.
    fewer = ["full", "kvdirect"]
    assert text(h.next_send(session, **_controls(strategies=fewer))).startswith(
        f"Next Send removes {spec('h2o')}, {spec('snapkv')};"
    )
    statuses = _statuses(demo, h.send(session, "Last.", **_controls(strategies=fewer)))
    assert not any("Adding" in s or "rebuilding" in s for s in statuses) and statuses[-1].startswith("Done: 4 turn(s)")
    kvdirect = next(label for label in want if label.startswith("kvdirect"))
    assert session.shown == ["full", kvdirect] and set(session.result["strategies"]) == {"full", kvdirect}
