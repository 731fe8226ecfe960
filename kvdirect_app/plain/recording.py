"""Recordings: a run's every event, kept in one file, played back in the browser.

A recording is what the page shows, not a summary of it: the engine's own
event stream (the same plain dicts `ui.session.Session.apply` folds live:
each pane's token and text per step, bytes measured and by formula, per-op
times, KL, the turn summaries, the final results), each event stamped with
the seconds since the run began (`t`), the token maps of every layer at the
end, and what the run was (`meta`: model, device, dtype, threads, kernels,
the strategies' specs, the turns, the date, the commit, the command that
made it).  Playing it back folds the same events into a fresh Session at
the recorded pace (or faster): every number on screen is the recorded one,
and nothing is recomputed.

The file is JSON (gzip-compressed when its name ends in ``.gz``) with
``format`` and ``version`` at the top; `load` refuses any other format or
version with a message naming it.  Token maps are kept compactly: one
character per token and layer (`STATE_CODES`).

Plain Python (no torch): the UI reads recordings with it.
"""

from __future__ import annotations

import copy
import datetime as _dt
import gzip
import io
import json
import subprocess
import time
from pathlib import Path

from . import jsonfile
from .errors import UserError
from .paths import data

FORMAT = "kvdirect-studio-recording"
VERSION = 1
EXPECTED = "a recording (bench run --record FILE, bench record, or the Export tab's .json.gz)"
STATE_CODES = {"kv": "k", "residual": "r", "anchor": "a", "replayed": "p", "evicted": "e"}
STATE_NAMES = {code: name for name, code in STATE_CODES.items()}
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = data("presets") / "recordings"
MAX_BYTES = jsonfile.MAX_BYTES  # a file larger than this, or a gzip one inflating past it, is refused unparsed


class RecordingError(UserError):
    """A file that is not a recording this build can play (format, version, contents)."""


def commit() -> str | None:
    """The checkout's commit (short; "+changes" when the tracked files differ from it), or None outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        )
        if out.returncode != 0 or not out.stdout.strip():
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class Recorder:
    """Collects a run's events as they happen (`add`), stamped with the seconds since the recorder started.

    Events are copied (the engine may reuse nothing, but a caller could mutate
    what it folded), so the file holds what the engine said at that moment.
    """

    def __init__(self, meta: dict):
        self.meta = dict(meta)
        self.events: list[dict] = []
        self.t0 = time.monotonic()

    def resume(self) -> None:
        """The next event follows the last one at once: the time a visitor spent typing is not the run's."""
        last = self.events[-1]["t"] if self.events else 0.0
        self.t0 = time.monotonic() - last

    def add(self, event: dict) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 4), **copy.deepcopy(event)})

    def finish(self, token_maps: dict | None, attention_maps: dict | None = None) -> dict:
        """The recording as plain data (write it with `save`); `attention_maps` is the engine's `attention_maps()`."""
        meta = {
            "recorded_at": today(),
            "commit": commit(),
            **self.meta,
            "seconds": self.events[-1]["t"] if self.events else 0.0,
        }
        start = next((e for e in self.events if e["type"] == "start"), None)
        if start is not None:
            meta.setdefault("threads", start.get("threads"))
            meta.setdefault("kernels", start.get("kernels_line"))
        done = next((e for e in reversed(self.events) if e["type"] == "done"), None)
        if done is not None:
            result = done["result"]
            for key in ("model", "device", "dtype", "threads"):
                if meta.get(key) is None:
                    meta[key] = result.get(key)
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": meta,
            "events": self.events,
            "token_maps": encode_maps(token_maps or {}),
            "attention": encode_attention(attention_maps or {}),
        }


ATTENTION_SCALE = 10_000  # a recording keeps attention weights to 4 decimals


def encode_attention(maps: dict) -> dict:
    """The engine's `attention_maps()` -> per lane its position, turn and per layer one integer per token:
    round(weight * 10,000), -1 where the layer was not handed the token.  The tokens are the token map's."""
    return {
        label: {
            "position": m["position"],
            "turn": m["turn"],
            "layers": [[-1 if w is None else round(w * ATTENTION_SCALE) for w in weights] for weights in m["layers"]],
        }
        for label, m in maps.items()
    }


def attention_layer(recording: dict, label: str, layer: int) -> dict | None:
    """One layer of a recording's attention snapshot, as the engine's `attention_map` gives it (weights to 4
    decimals), or None where the recording holds none for `label` (a recording made before snapshots)."""
    m = (recording.get("attention") or {}).get(label)
    if not m or not m["layers"]:
        return None
    weights = m["layers"][min(max(layer, 0), len(m["layers"]) - 1)]
    tokens = recording.get("token_maps", {}).get(label, {}).get("tokens", [])
    return {
        "position": m["position"],
        "turn": m["turn"],
        "tokens": tokens[: m["position"] + 1],
        "weights": [None if w < 0 else w / ATTENTION_SCALE for w in weights],
    }


def encode_maps(maps: dict) -> dict:
    """{label: {"tokens": [...], "states": [[state per token] per layer]}} -> one code string per layer."""
    out = {}
    for label, m in maps.items():
        layers = []
        for states in m["states"]:
            unknown = set(states) - set(STATE_CODES)
            if unknown:
                raise ValueError(f"token map of {label}: unknown states {sorted(unknown)}")
            layers.append("".join(STATE_CODES[s] for s in states))
        out[label] = {"tokens": list(m["tokens"]), "states": layers}
    return out


def map_layer(maps: dict, label: str, layer: int) -> dict | None:
    """One layer of a recording's token map, as the engine's `token_map` gives it ({"tokens", "states"})."""
    m = maps.get(label)
    if m is None or not m["states"]:
        return None
    codes = m["states"][min(max(layer, 0), len(m["states"]) - 1)]
    return {"tokens": m["tokens"], "states": [STATE_NAMES[c] for c in codes]}


def decode_maps(maps: dict) -> dict:
    """The inverse of `encode_maps` (lists of state names per layer)."""
    return {
        label: {"tokens": m["tokens"], "states": [[STATE_NAMES[c] for c in codes] for codes in m["states"]]}
        for label, m in maps.items()
    }


def save(recording: dict, path: str | Path) -> Path:
    """Write a recording; gzip when the name ends in .gz.  Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(recording, separators=(",", ":")).encode()
    if path.name.endswith(".gz"):
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as sink:  # mtime 0: the same run, the same bytes
            sink.write(data)
        data = buffer.getvalue()
    path.write_bytes(data)
    return path


def parse(data: bytes, name: str = "recording") -> dict:
    """A recording from a file's bytes (gzip or not), checked; raises RecordingError naming what is wrong.  A gzip
    file is inflated as a stream, refused once it passes `MAX_BYTES`: a small file may unpack to gigabytes."""
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(
                f"{name}: the file is larger than {jsonfile.mib(MAX_BYTES)}, the most the studio opens; "
                f"expected {EXPECTED}"
            )
        if data[:2] == b"\x1f\x8b":
            data = jsonfile.inflate(data, name, EXPECTED, MAX_BYTES)
        recording = jsonfile.parse(data, name, EXPECTED)
    except ValueError as e:
        raise RecordingError(str(e)) from None
    return check(recording, name)


def check(recording, name: str = "recording") -> dict:
    problem = jsonfile.not_an_object(recording, name, EXPECTED)
    if problem:
        raise RecordingError(problem)
    if recording.get("format") != FORMAT:
        found = recording.get("format")
        results = isinstance(recording, dict) and ("strategies" in recording or "schema_version" in recording)
        what = (
            f"a results file, {recording.get('schema')} version {recording.get('schema_version')}"
            if results and "schema_version" in recording
            else "a bench run --json results file"
        )
        hint = f" ({what}: the page plays recordings; make one with bench run --record FILE)" if results else ""
        raise RecordingError(f"{name}: not a recording (format {found!r}){hint}; expected format {FORMAT!r}")
    version = recording.get("version")
    if version != VERSION:
        raise RecordingError(
            f"{name}: recording version {version!r} is not supported; this build plays version "
            f"{VERSION} (re-record it with this build's bench record / bench run --record)"
        )
    events = recording.get("events")
    if not isinstance(events, list) or not events or not isinstance(recording.get("meta"), dict):
        raise RecordingError(f"{name}: a version {VERSION} recording must have meta and a non-empty event list")
    kinds = [e.get("type") if isinstance(e, dict) else None for e in events]
    if kinds[0] != "start" or "done" not in kinds:
        raise RecordingError(
            f"{name}: the events must begin with 'start' and include 'done' (found "
            f"{kinds[0]!r} first{'' if 'done' in kinds else ', no done'})"
        )
    if any(not isinstance(e.get("t"), (int, float)) for e in events):
        raise RecordingError(f"{name}: every event needs its time 't' in seconds")
    maps = recording.get("token_maps", {})
    if not isinstance(maps, dict) or any(set("".join(m.get("states", []))) - set(STATE_NAMES) for m in maps.values()):
        raise RecordingError(f"{name}: token maps use only the codes {''.join(STATE_NAMES)}")
    attention = recording.get("attention", {})
    if not isinstance(attention, dict) or any(
        not isinstance(m, dict)
        or not isinstance(m.get("position"), int)
        or not isinstance(m.get("layers"), list)
        or any(not isinstance(w, list) or len(w) != m["position"] + 1 for w in m["layers"])
        for m in attention.values()
    ):
        raise RecordingError(
            f"{name}: each attention snapshot needs its position and, per layer, one weight per token up to it"
        )
    return recording


def load(path: str | Path) -> dict:
    """A recording file (a shipped one, an upload, a command line's), its size checked before a byte is read."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"recording: no file {path}")
    try:
        data = jsonfile.read(path, path.name, EXPECTED, MAX_BYTES)
    except ValueError as e:
        raise RecordingError(str(e)) from None
    except OSError:
        raise RecordingError(f"{path.name}: the file could not be read; expected {EXPECTED}") from None
    return parse(data, path.name)


def shipped() -> dict[str, Path]:
    """The recordings in presets/recordings/, by file stem (without .json/.json.gz)."""
    if not SHIPPED.is_dir():
        return {}
    files = sorted(SHIPPED.glob("*.json.gz")) + sorted(SHIPPED.glob("*.json"))
    return {p.name.removesuffix(".gz").removesuffix(".json"): p for p in files}


def label(meta: dict) -> str:
    """'recorded on <device>, <date>': what every number of a played-back recording is labelled with."""
    date = str(meta.get("recorded_at", "?")).split(" ")[0]
    threads = f", {meta['threads']} thread(s)" if meta.get("threads") and meta.get("device") == "cpu" else ""
    return f"recorded on {meta.get('device', '?')}{threads}, {date}"


def describe(meta: dict) -> str:
    """One line: what the recording is (scenario or turns, model, how long it took)."""
    what = meta.get("scenario") or f"{len(meta.get('turns', []))} turn(s)"
    return (
        f"{what} on {meta.get('model', '?')} ({meta.get('dtype', '?')}), {len(meta.get('specs', []))} panes, "
        f"{meta.get('seconds', 0):.0f} s {label(meta)}"
    )
