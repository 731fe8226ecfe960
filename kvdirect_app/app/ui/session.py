"""One browser session's view of a conversation, built from the engine's events.

Plain Python (no gradio, no torch): `Session.apply(event)` folds each engine
event into per-strategy records (text with token boundaries, bytes, latency,
agreement with the full cache) that the panes and plots are drawn from.
Token agreement follows `agreement.token_match`: every position the full
cache produced counts; a strategy that stops early or runs on is a mismatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...plain.recording import label as recording_label
from .settings import REFERENCE, RunConfig


@dataclass
class TurnReply:
    """A strategy's reply to one user turn, with where each token's text starts."""

    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    text: str = ""

    def add(self, token: int, text: str):
        previous = self.text
        same = 0
        while same < min(len(previous), len(text)) and previous[same] == text[same]:
            same += 1
        self.tokens.append(token)
        self.starts.append(same)
        self.text = text

    def piece(self, index: int) -> tuple[int, int]:
        """Character span of token `index` in the reply text.  A token that adds no character of its own (the
        first bytes of a character that a later token completes) spans the character it is part of; a token
        with no text at all (end of sequence) spans nothing, at the end."""
        start = self.starts[index]
        end = next((s for s in self.starts[index + 1 :] if s > start), len(self.text))
        return start, max(start, end)

    @property
    def complete(self) -> int:
        """Length of the text without a trailing cut character: a reply that ends inside a multi-byte character
        (end of turn, token limit) decodes its last bytes as U+FFFD."""
        return len(self.text.rstrip("\ufffd"))


def memory_row(ev: dict, step: int, position: int, turn: int, index: int) -> dict:
    """A lane's bytes after a step, from its step event, as the memory curve and the exports read them."""
    return {
        "step": step,
        "position": position,
        "turn": turn,
        "index": index,
        "seen": ev["seen"],
        "persistent": ev["persistent_bytes"],
        "peak": ev["peak_bytes"],
        "formula": ev["formula_bytes"],
        "formula_peak": ev["formula_peak_bytes"],
        # (recordings made before the allocator's figures have neither)
        "peak_source": ev.get("peak_source"),
        "agrees": ev.get("formula_agrees"),
        "outside": ev.get("outside_bytes"),
    }


JOINING = ("drop", "join", "catch_up_turn", "catch_up_step", "catch_up_turn_end", "caught_up")  # `Session._joining`


@dataclass
class LaneView:
    label: str
    replies: list[TurnReply] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)  # per step: position, seen, measured state and peak, formula bytes
    turns: list[dict] = field(default_factory=list)  # per finished turn: between turns, peak in turn, ms/token
    latency: list[dict] = field(default_factory=list)  # per fed decode step: ms per op
    agreement: list[dict] = field(default_factory=list)  # per reference position: running match, KL mean
    matched: int = 0
    total: int = 0
    divergence: tuple[int, int] | None = None  # (turn, token index) of the first token that differs
    active: bool = False

    @property
    def match(self) -> float | None:
        return self.matched / self.total if self.total else None

    def turn_figures(self) -> dict:
        """Between turns (after the last finished turn), peak during the current (or last) turn, and its ms per
        decode token: the three numbers each pane shows side by side."""
        current = [row for row in self.memory if row["turn"] == (self.memory[-1]["turn"] if self.memory else -1)]
        peaks = [row["peak"] for row in current if row["peak"] is not None]
        formula_peaks = [row["formula_peak"] for row in current]
        ms = [row["total"] for row in self.latency if row.get("turn") == (current[0]["turn"] if current else -1)]
        return {
            "between": self.turns[-1]["between_turns"] if self.turns else None,
            "formula_between": self.turns[-1]["formula_between_turns"] if self.turns else None,
            "peak": max(peaks) if peaks else None,
            "formula_peak": max(formula_peaks) if formula_peaks else None,
            "peak_source": current[-1].get("peak_source") if current else None,
            "outside": current[-1].get("outside") if current else None,
            "ms_per_token": sum(ms) / len(ms) if ms else None,
        }

    def disagreements(self) -> int:
        """Steps so far where the measured held bytes differed from the strategy's formula (a hidden copy, or a
        formula that is wrong)."""
        return sum(row.get("agrees") is False for row in self.memory)

    def op_means(self, turn: int | None = None, steps: int | None = None) -> dict[str, float]:
        """Mean ms per decode step of each op the engine reports, over turn `turn`'s steps (None: every turn),
        divided by `steps` where given (the turn's step count: a step the lane sat out counts as zero, as in
        `Session.step_means`), else by the lane's own steps.  A row without an op, as from an older recording,
        counts it as zero."""
        rows = [row for row in self.latency if turn is None or row.get("turn") == turn]
        if not rows:
            return {}
        ops = dict.fromkeys(k for row in rows for k in row if k not in ("total", "step", "turn"))
        return {op: sum(row.get(op, 0.0) for row in rows) / (steps or len(rows)) for op in ops}


@dataclass
class Session:
    """Per-browser-session state, held in a `gr.State` (never shared between users)."""

    config: RunConfig | None = None
    engine: object = None  # the Engine that holds this conversation (None on ZeroGPU: rebuilt per call)
    user_turns: list[str] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)
    lanes: dict[str, LaneView] = field(default_factory=dict)
    rss: list[dict] = field(default_factory=list)
    # Per decode step, as a visitor sees it: its wall time, each lane's own ms, the instruments' ms and the rest.
    step_times: list[dict] = field(default_factory=list)
    # No lane's bytes after the last step (blocks outside every region, the measurement's own, shared memory) and
    # the most they reached: the board's "unattributed" row; None where no meter reads them.
    unattributed: dict | None = None
    unattributed_peak: int = 0
    steps: int = 0
    # Tokens of the conversation so far on the engine's clock: every prompt (the full cache's) plus one per step,
    # the same for every lane at a step.  A lane's own `seen` (its cache's length) differs: it counts its own
    # replies, which end earlier or run on, and its own prompts.
    position: int = 0
    result: dict | None = None
    token_maps: dict | None = None  # filled by the run itself where the engine does not outlive it
    attention_maps: dict | None = None  # the same, for the attention snapshots (`Engine.attention_maps`)
    busy: bool = False
    stop_requested: bool = False
    frontier_cancel: bool = False  # the frontier drawing's Cancel: it ends after the step in progress
    workdir: str | None = None
    load_number: int = 0  # the newest model choice of this session (an older load's result is not shown)
    expect: tuple[int, str] | None = None  # a played scenario's (turn, the words its right answer contains)
    about: dict = field(default_factory=dict)  # label -> {"doc", "notes"}: the engine's start event says
    kernels_line: str = ""  # the run's kernels in a few words (the engine's start event)
    memory_instrument: str = ""  # what measured the bytes (the engine's start event)
    recording: dict | None = None  # the meta of the recording on screen (None: a live run or nothing)
    recorded: dict | None = None  # that recording itself (Export writes it back unchanged)
    recorder: object = None  # a live run's `recording.Recorder` (the Export tab's recording)
    scenario: str | None = None  # the scripted conversation this run plays, if any
    pending: str | None = None  # the first screen's recording, by name, until a handler folds it in (`unfold`)
    asked: tuple | None = None  # the action the page asked to confirm: the same again goes on, any other cancels it
    pump: object = None  # the running turn's `runner.Pump` (Stop asks it which step ends the turn)
    stopping: tuple[int, int] | None = None  # (turn, step) that Stop said the run ends after
    seen: list[dict] = field(default_factory=list)  # per turn: its first and last token's time, steps (`seen_rate`)
    memory_words: tuple[str, dict] = ("", {})  # (model, strategy -> a sentence): `geometry_panel.memory_words`
    # This machine's best time for the live run's decode step's linears over its rows (`Conversation.roofline`):
    # the latency plot's line.  None for a recording (measured elsewhere) and off the CPU.
    roofline: dict | None = None
    joining: tuple[int, int, int] | None = None  # panes joining: (turn, step, turns) of their replay (`catch_up_*`)
    last_plot: float = 0.0
    sent: dict = field(default_factory=dict)  # component -> the text or messages the page was last sent (`render`)
    sent_shown: tuple = ()  # the panes shown when the page was last drawn whole
    plot_cost: float = 0.0  # seconds the last live plots took to build (they share the cores with the engine)

    def clear(self):
        """A new conversation; what belongs to the loaded model stays (its load number, what its memory is)."""
        keep = self.workdir, self.load_number, self.memory_words
        self.__init__()
        self.workdir, self.load_number, self.memory_words = keep

    @property
    def recorded_label(self) -> str:
        """'recorded on <device>, <date>' while a recording is on screen, else ''."""
        return recording_label(self.recording) if self.recording else ""

    @property
    def reference(self) -> LaneView | None:
        return self.lanes.get(REFERENCE)

    def says_expected(self, label: str) -> bool | None:
        """Whether this pane's reply to the scenario's question contains the right answer (None: not asked yet)."""
        lane = self.lanes.get(label)
        if self.expect is None or lane is None or len(lane.replies) <= self.expect[0]:
            return None
        return self.expect[1] in lane.replies[self.expect[0]].text

    def first_divergence_index(self, label: str) -> int | None:
        """The divergence as one index over the concatenated turns (as `bench run` reports it)."""
        lane, ref = self.lanes[label], self.reference
        if lane.divergence is None:
            return None
        turn, index = lane.divergence
        return sum(len(r.tokens) for r in ref.replies[:turn]) + index

    def apply(self, event: dict):
        kind = event["type"]
        if kind == "start":
            self.user_turns, self.steps, self.position, self.rss, self.result, self.token_maps = (
                [],
                0,
                0,
                [],
                None,
                None,
            )
            self.step_times = []
            self.unattributed, self.unattributed_peak = None, 0  # no lane's bytes (`Report.unattributed`)
            self.seen = []
            self.attention_maps = None
            self.shown = list(event["strategies"])
            self.about = event.get("about", {})
            self.kernels_line = event.get("kernels_line", "")
            self.memory_instrument = event.get("memory", "")
            self.lanes = {label: LaneView(label) for label in dict.fromkeys([REFERENCE, *self.shown])}
        elif kind == "turn":
            self.user_turns.append(event["user"])
            self.position += len(event["chunk_ids"])
            # (where the turn's steps and positions start: a pane joining later places its replayed steps there)
            self.seen.append({"t0": None, "t1": None, "steps": 0, "step0": self.steps, "pos0": self.position})
            for lane in self.lanes.values():
                lane.replies.append(TurnReply())
                lane.active = True
        elif kind == "step":
            self._step(event)
            if self.seen:  # a recording's events carry their recorded time; a live one's arrive now
                now = event.get("t", time.monotonic())
                clock = self.seen[-1]
                clock["t0"] = now if clock["t0"] is None else clock["t0"]
                clock["t1"], clock["steps"] = now, clock["steps"] + 1
        elif kind == "turn_end":
            for label, text in event["texts"].items():
                if label in self.lanes:
                    self.lanes[label].replies[-1].text = text
            for label, figures in event.get("bytes", {}).items():
                if label in self.lanes:
                    self.lanes[label].turns.append(figures)
            for lane in self.lanes.values():
                lane.active = False
        elif kind in JOINING:
            self._joining(event)
        elif kind == "done":
            self.result = event["result"]
        elif kind == "token_maps":
            self.token_maps = event["maps"]
        elif kind == "attention_maps":
            self.attention_maps = event["maps"]

    def _joining(self, event: dict):
        """Panes leave ("drop") or join ("join") between turns; a joining pane's replay of the earlier turns
        ("catch_up_turn", "catch_up_step", "catch_up_turn_end") fills its replies and bytes at the steps they
        stand for, and its token match against the reference's tokens (no KL: `engine/joining.py`)."""
        kind = event["type"]
        if kind == "drop":
            for label in event["dropped"]:
                if label != REFERENCE:
                    self.lanes.pop(label, None)
            self.shown = list(event["strategies"])
        elif kind == "join":
            self.shown = list(event["strategies"])
            self.about.update(event.get("about", {}))
            for label in event["added"]:
                self.lanes.setdefault(label, LaneView(label))
        elif kind == "catch_up_turn":
            self.joining = (event["turn"], 0, event["turns"])
            for label in event["strategies"]:
                self.lanes[label].replies.append(TurnReply())
                self.lanes[label].active = True
        elif kind == "catch_up_step":
            turn, index = event["turn"], event["index"]
            self.joining = (turn, index + 1, self.joining[2] if self.joining else turn + 1)
            clock = self.seen[turn] if turn < len(self.seen) else {}
            step, position = clock.get("step0", 0) + index + 1, clock.get("pos0", 0) + index + 1
            ref = self.reference.replies[turn].tokens if self.reference and turn < len(self.reference.replies) else []
            for label, ev in event["lanes"].items():
                lane = self.lanes[label]
                lane.replies[turn].add(ev["token_id"], ev["text"])
                lane.active = ev["active"]
                lane.memory.append(memory_row(ev, step, position, turn, index))
                same = index < len(ref) and ev["token_id"] == ref[index]
                if not same and lane.divergence is None:
                    lane.divergence = (turn, index)
                if index < len(ref):
                    lane.total += 1
                    lane.matched += same
                    lane.agreement.append({"step": step, "match": lane.matched / lane.total, "kl": None})
        elif kind == "catch_up_turn_end":
            for label, text in event["texts"].items():
                self.lanes[label].replies[event["turn"]].text = text
                self.lanes[label].active = False
            for label, figures in event.get("bytes", {}).items():
                self.lanes[label].turns.append(figures)
        elif kind == "caught_up":
            self.joining = None

    def _step(self, event: dict):
        self.steps += 1
        self.position += 1
        turn, index, events = event["turn"], event["index"], event["lanes"]
        ref = events.get(REFERENCE)
        for label, lane in self.lanes.items():
            ev = events.get(label)
            if ev is not None:
                lane.replies[turn].add(ev["token_id"], ev["text"])
                lane.active = ev["active"]
                lane.memory.append(memory_row(ev, self.steps, self.position, turn, index))
                if ev["active"]:  # the token was fed: the step's timings are of this token's forward
                    lane.latency.append({"step": self.steps, "turn": turn, **ev["latency_ms"]})
            else:
                lane.active = False
            if ref is None and ev is None:
                continue
            same = ref is not None and ev is not None and ev["token_id"] == ref["token_id"]
            if not same and lane.divergence is None:
                lane.divergence = (turn, index)
            if ref is not None:
                lane.total += 1
                lane.matched += same
                kl = ev["kl_mean"] if ev is not None else (lane.agreement[-1]["kl"] if lane.agreement else 0.0)
                lane.agreement.append({"step": self.steps, "match": lane.matched / lane.total, "kl": kl})
        rss = next(iter(events.values())).get("rss_bytes") if events else None  # read after the step
        if rss is not None:
            self.rss.append({"step": self.steps, "position": self.position, "rss": rss})
        if event.get("unattributed_bytes") is not None:  # (none without a meter, or in an older recording)
            self.unattributed = event["unattributed_bytes"]
            self.unattributed_peak = max(self.unattributed_peak, self.unattributed["bytes"])
        if "step_ms" in event:  # (a recording made before step times has none)
            self.step_times.append(
                {
                    "step": self.steps,
                    "turn": turn,
                    "step_ms": event["step_ms"],
                    "lanes_ms": event["lanes_ms"],
                    "measurement_ms": event["measurement_ms"],
                    "engine_ms": event.get("engine_ms", {}),
                    "unattributed_ms": event["unattributed_ms"],
                }
            )

    def seen_rate(self) -> float | None:
        """Tokens per second each pane streamed at in the current (or last) turn, as a visitor saw them: every pane
        gets one token per lockstep step, so it is the same for all (from its first token to its last)."""
        clock = self.seen[-1] if self.seen else None
        if clock is None or clock["steps"] < 2 or clock["t1"] <= clock["t0"]:
            return None
        return (clock["steps"] - 1) / (clock["t1"] - clock["t0"])

    def step_means(self) -> dict | None:
        """The current (or last) turn's decode steps, means in ms: the wall time (what every pane's speed is, as
        seen), each lane's own time (`own`: a step it sat out counts as 0, so the column adds up to `lanes`), the
        lanes' own time together, each instrument's, the engine's own (choosing tokens, detokenising,
        events) and the rest no clock covered; they add up to the wall."""
        if not self.step_times:
            return None
        turn = self.step_times[-1]["turn"]
        rows = [r for r in self.step_times if r["turn"] == turn]
        n = len(rows)
        names = sorted({name for r in rows for name in r["measurement_ms"]})
        measured = {name: sum(r["measurement_ms"].get(name, 0.0) for r in rows) / n for name in names}
        own = {label: sum(r["lanes_ms"].get(label, 0.0) for r in rows) / n for label in self.shown}
        return {
            "steps": n,
            "wall": sum(r["step_ms"] for r in rows) / n,
            "own": own,
            "lanes": sum(sum(r["lanes_ms"].values()) for r in rows) / n,
            "measurement": measured,
            "engine": sum(sum(r["engine_ms"].values()) for r in rows) / n,
            "unattributed": sum(r["unattributed_ms"] for r in rows) / n,
        }

    def step_rows(self) -> list[dict]:
        """One row per strategy and step: what the CSV export holds."""
        rows = []
        for label in self.shown:
            lane = self.lanes[label]
            latency = {row["step"]: row for row in lane.latency}
            agreement = {row["step"]: row for row in lane.agreement}
            for mem in lane.memory:
                lat = latency.get(mem["step"], {})
                agree = agreement.get(mem["step"], {})
                reply = lane.replies[mem["turn"]]
                rows.append(
                    {
                        "strategy": label,
                        "step": mem["step"],
                        "turn": mem["turn"],
                        "index": mem["index"],
                        "token_id": reply.tokens[mem["index"]],
                        "position": mem["position"],
                        "seen": mem["seen"],
                        "persistent_bytes": mem["persistent"],
                        "peak_bytes": mem["peak"],
                        "formula_bytes": mem["formula"],
                        "formula_peak_bytes": mem["formula_peak"],
                        **{f"{op}_ms": v for op, v in lat.items() if op not in ("step", "turn")},
                        "token_match_so_far": agree.get("match"),
                        "kl_mean_so_far": agree.get("kl"),
                    }
                )
        return rows
