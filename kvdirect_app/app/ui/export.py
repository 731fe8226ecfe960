"""Downloads: the run as JSON and CSV (pandas), the plots as one HTML file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd

from ...plain.recording import save
from .plots import all_figures
from .session import Session


def write_exports(session: Session, figures: dict | None = None) -> dict[str, str]:
    """Write the session's run into its own folder; returns {kind: path}.  `figures`: the plots just drawn for the
    page (`all_figures`), drawn here otherwise."""
    if session.workdir is None:
        session.workdir = tempfile.mkdtemp(prefix="kvdirect-studio-")
    folder = Path(session.workdir)
    paths = {
        kind: folder / name
        for kind, name in (
            ("json", "kvdirect-run.json"),
            ("steps", "kvdirect-steps.csv"),
            ("summary", "kvdirect-summary.csv"),
            ("plots", "kvdirect-plots.html"),
            ("recording", "kvdirect-recording.json.gz"),
        )
    }
    run = {"user_turns": session.user_turns, "results": session.result, "steps": session.step_rows()}
    paths["json"].write_text(json.dumps(run, indent=1))
    pd.DataFrame(session.step_rows()).to_csv(paths["steps"], index=False)
    strategies = (session.result or {}).get("strategies", {})
    summary = pd.json_normalize([{"strategy": label, **r} for label, r in strategies.items()])
    summary = summary.drop(
        columns=[c for c in summary.columns if c.endswith("token_ids") or c == "turn_texts"], errors="ignore"
    )
    summary.to_csv(paths["summary"], index=False)
    recording = session.recorded
    if recording is None and session.recorder is not None:
        maps = session.token_maps
        if maps is None and session.engine is not None:
            maps = session.engine.token_maps()
        attention = session.attention_maps
        if attention is None and session.engine is not None:
            attention = session.engine.attention_maps()
        recording = session.recorder.finish(maps, attention)
        recording["meta"]["turns"] = list(session.user_turns)
    if recording is not None:
        save(recording, paths["recording"])
    figures = list((figures or all_figures(session)).values())
    parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    paths["plots"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>KV-Direct Studio plots</title>"
        "</head><body>" + "\n".join(parts) + "</body></html>"
    )
    return {kind: str(path) for kind, path in paths.items() if path.exists()}
