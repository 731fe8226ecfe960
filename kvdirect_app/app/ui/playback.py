"""Recordings on the page: which are offered, opening one, folding its events into a Session at a pace.

The page draws a recording exactly as it drew the live run: the recorded
engine events go through the same `Session.apply` and the same drawing code;
the only thing that changes is who produced the events.  Every figure is
labelled with `Session.recorded_label` ("recorded on <device>, <date>").
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Iterator

from ...plain.recording import RecordingError, describe, load, shipped
from .session import Session

SPEEDS = {"x1 (recorded pace)": 1.0, "x4": 4.0, "x16": 16.0, "instant": 0.0}
DEFAULT_SPEED = "x16"
FIRST = ("recall-smollm2-135m", "recall")  # what the page opens with, the first of these that is shipped


def offered() -> list[tuple[str, str]]:
    """(label, name) of every shipped recording, for the picker."""
    out = []
    for name, path in shipped().items():
        try:
            meta = _cached(str(path), path.stat().st_mtime)["meta"]
        except RecordingError:
            continue
        out.append((f"{name} · {describe(meta)}", name))
    return out


def first_name() -> str | None:
    names = [name for _, name in offered()]
    return next((n for n in FIRST if n in names), names[0] if names else None)


@functools.lru_cache(maxsize=8)
def _cached(path: str, mtime: float) -> dict:
    return load(path)


def open_recording(choice: str | None = None, upload: str | None = None) -> dict:
    """A shipped recording by name, or an uploaded file's path; raises RecordingError naming what is wrong."""
    if upload:
        return load(upload)
    table = shipped()
    if not choice or choice not in table:
        raise RecordingError(f"recording: unknown {str(choice)[:60]!r}; shipped: {', '.join(table) or 'none'}")
    path = table[choice]
    return _cached(str(path), path.stat().st_mtime)


def start(session: Session, recording: dict) -> None:
    """Make `session` show `recording` from its beginning (nothing live left in it)."""
    session.clear()
    meta = recording["meta"]
    session.recording, session.recorded = meta, recording
    session.scenario = meta.get("scenario")
    session.expect = tuple(meta["expect"]) if meta.get("expect") else None


def finish(session: Session) -> None:
    session.token_maps = session.recorded.get("token_maps", {}) if session.recorded else None


def fold(recording: dict, session: Session | None = None) -> Session:
    """Every event of `recording` applied at once: the page as it stood at the recording's end."""
    session = session or Session()
    start(session, recording)
    for event in recording["events"]:
        session.apply(event)
    finish(session)
    return session


def paced(recording: dict, speed: float, should_stop=lambda: False) -> Iterator[dict]:
    """The recording's events at `speed` times the recorded pace (0: at once); stops early when asked."""
    events = recording["events"]
    t0, begun = events[0]["t"], time.monotonic()
    for event in events:
        if speed > 0:
            wait = (event["t"] - t0) / speed - (time.monotonic() - begun)
            while wait > 0 and not should_stop():
                time.sleep(min(wait, 0.1))
                wait = (event["t"] - t0) / speed - (time.monotonic() - begun)
        if should_stop():
            return
        yield event


def uploaded_name(upload: str | None) -> str:
    return Path(upload).name if upload else ""


def unfold(session: Session) -> Session:
    """A visitor's session that still shows the page's first screen gets that recording folded in (once)."""
    if session.pending and not session.shown and not session.busy:
        name, session.pending = session.pending, None
        try:
            fold(open_recording(name), session)
        except RecordingError:
            session.clear()
    session.pending = None
    return session
