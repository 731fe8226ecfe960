"""A streamed update carries only what a step changed: the panes' chats and headers that changed since the last
update, the scoreboard, the status, the panes' boxes where the panes shown changed (and the plots when due); the
buttons and controls keep what the run's first update gave them.  The run's first and last updates draw everything.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gradio_client")

from kvdirect_app.app.ui import turn_buttons  # noqa: E402
from kvdirect_app.app.ui.session import Session  # noqa: E402

from .test_app import _controls  # noqa: E402


def test_a_live_update_carries_what_changed_and_shows_the_panes_after_clear(app, monkeypatch):
    """Mutations: a live update that never sends the boxes (after Clear the panes stayed hidden until Done), or one
    that re-sends every chat, each fails this."""
    demo, _ = app
    h, s = demo.kvd_handlers, demo.kvd_handlers.s
    monkeypatch.setattr(turn_buttons, "UI_EVERY_S", 0.0)  # an update after every event
    session = Session()
    h.clear(session)
    updates = list(h.send(session, "Hello.", **_controls(strategies=["full", "h2o"], max_new_tokens=6)))
    start = next(i for i, u in enumerate(updates) if s.actions.send in u)  # the run's first update (after the load's)
    live, last = updates[start + 1 : -1], updates[-1]
    assert s.actions.send in last
    assert live and not any(s.actions.send in u or s.actions.stop in u or s.controls.model in u for u in live)
    shown = [p for p in s.panes[: len(session.shown)]]
    assert len(shown) == 2
    # The boxes of the panes shown are made visible while the turn streams, not only at its end.
    boxes = [i for i, u in enumerate(live) if all(p.box in u for p in shown)]
    assert boxes, "no streamed update showed the panes"
    tokens = [
        i for i, u in enumerate(live) if all(any(m["role"] == "assistant" for m in u.get(p.chat, [])) for p in shown)
    ]
    assert tokens and tokens[0] < len(live) - 1, "no pane showed a reply before the turn ended"
    # No chat is sent again unchanged.
    sent: dict = {}
    for u in live:
        for p in shown:
            if p.chat in u:
                assert u[p.chat] != sent.get(p.chat), "a chat re-sent unchanged"
                sent[p.chat] = u[p.chat]
    assert all(s.views.status in u for u in live)
