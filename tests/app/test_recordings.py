"""Recordings: a run's events kept in a file and played back; every figure equal to the live run's.

A recording is the engine's own event stream plus the token maps; the page folds a played-back recording
through the same `Session.apply` and draws it with the same code as a live run.  These tests check that
nothing is lost or changed on the way (record -> file -> open -> fold), that files this build cannot play
are refused with a message naming why, and that each shipped recording replays to the figures it holds.
"""

import copy
import gzip
import json
import re

import pytest

from kvdirect_app import bench
from kvdirect_app.app import service
from kvdirect_app.app.ui import playback, token_map_tab, views
from kvdirect_app.app.ui.plots import all_figures
from kvdirect_app.app.ui.scoreboard import scoreboard_html
from kvdirect_app.app.ui.session import Session
from kvdirect_app.app.ui.settings import default_names, expand
from kvdirect_app.plain import recording
from kvdirect_app.plain.recording import FORMAT, VERSION, Recorder, RecordingError
from kvdirect_app.plain.scenarios import scenarios

TINY = "tiny-llama"


def live_run(turns, specs, max_new_tokens=5, expect=None):
    """A live conversation folded into a Session, and its recording (as the page makes both)."""
    talk = service.Conversation(TINY, "cpu", "float32", specs, max_new_tokens)
    session = Session()
    session.expect = expect
    recorder = Recorder(
        {
            "source": "test",
            "model": TINY,
            "dtype": "float32",
            "specs": specs,
            "turns": turns,
            "max_new_tokens": max_new_tokens,
            "expect": list(expect) if expect else None,
            "scenario": "recall",
        }
    )
    events = [e for text in turns for e in talk.turn(text)] + [{"type": "done", "result": talk.results()}]
    for event in events:  # the page folds the recorded copy of each event: the same times as the recording's
        recorder.add(event)
        session.apply(recorder.events[-1])
    session.attention_live = talk.attention_maps()
    return session, recorder.finish(talk.token_maps(), session.attention_live), talk.token_maps()


def lanes_of(session: Session) -> dict:
    return {
        label: (
            lane.memory,
            lane.turns,
            lane.latency,
            lane.agreement,
            lane.divergence,
            lane.matched,
            lane.total,
            [(r.tokens, r.starts, r.text) for r in lane.replies],
        )
        for label, lane in session.lanes.items()
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    turns = scenarios()["recall"]["turns"][:3]
    specs = [expand(n, 24, 4, "exact", "step") for n in default_names()]
    session, rec, maps = live_run(turns, specs, expect=(2, "4127"))
    path = recording.save(rec, tmp_path_factory.mktemp("rec") / "run.json.gz")
    return session, rec, maps, path


def test_a_recording_round_trips_every_figure(recorded):
    live, _, maps, path = recorded
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # .gz: compressed
    opened = recording.load(path)
    played = playback.fold(opened)
    assert played.shown == live.shown and played.steps == live.steps and played.position == live.position
    assert lanes_of(played) == lanes_of(live)
    assert played.rss == live.rss and played.result == live.result and played.user_turns == live.user_turns
    assert played.expect == live.expect
    # The scoreboard and every plot draw the same numbers; only the "recorded on ..." labels are added.
    assert "recorded on cpu" in scoreboard_html(played)
    board = scoreboard_html(played)
    label = board[board.index(' <span class="kvd-recorded-label"') :]
    assert board.replace(label[: label.index("</span>") + 7], "") == scoreboard_html(live)
    for name, figure in all_figures(played).items():
        assert figure.to_dict()["data"] == all_figures(live)[name].to_dict()["data"], name
        assert "recorded on cpu" in figure.layout.title.text, name
    # Token maps: every layer of every pane, as the engine gave them.
    assert recording.decode_maps(opened["token_maps"]) == maps
    layers = len(maps["full"]["states"])
    for label in live.shown:
        for layer in (0, layers - 1):
            assert recording.map_layer(opened["token_maps"], label, layer) == {
                "tokens": maps[label]["tokens"],
                "states": maps[label]["states"][layer],
            }


def test_a_recording_keeps_the_attention_snapshot_to_four_decimals(recorded):
    live, _, maps, path = recorded
    opened = recording.load(path)
    played = playback.fold(opened)
    attention = live.attention_live
    assert set(attention) == set(live.shown) and len(attention["full"]["layers"]) == len(maps["full"]["states"])
    for label, m in attention.items():
        for layer, weights in enumerate(m["layers"]):
            got = recording.attention_layer(opened, label, layer)
            assert got["position"] == m["position"] and got["tokens"] == m["tokens"]
            assert [w is None for w in got["weights"]] == [w is None for w in weights], (label, layer)
            assert max(abs(a - b) for a, b in zip(got["weights"], weights) if a is not None) <= 0.5e-4
    # The page draws it: the full cache and the strategy, the strategy's evicted tokens marked.
    h2o = next(label for label in live.shown if label.startswith("h2o"))
    layer = max(range(len(maps["full"]["states"])), key=lambda j: attention[h2o]["layers"][j].count(None))
    figure = token_map_tab.attention_plot(played, h2o, layer)
    names = [trace.name for trace in figure.data]
    assert names[:2] == ["Full KV cache", "H2O"]
    crosses = next(trace for trace in figure.data if trace.name.startswith("evicted by"))
    evicted = [i for i, w in enumerate(attention[h2o]["layers"][layer]) if w is None]
    assert list(crosses.x) == evicted
    same = attention[h2o]["tokens"] == attention["full"]["tokens"]
    assert ("of the full cache's attention" in figure.layout.title.text) == same


def test_a_mutated_recording_shows_other_figures(recorded):
    """The round trip's check can fail: one byte figure changed in the file changes what the page draws."""
    live, rec, _, _ = recorded
    changed = copy.deepcopy(rec)
    step = next(e for e in changed["events"] if e["type"] == "step")
    lane = next(iter(step["lanes"].values()))
    lane["persistent_bytes"] = (lane["persistent_bytes"] or 0) + 1
    assert lanes_of(playback.fold(changed)) != lanes_of(live)


def test_the_recording_holds_what_the_run_was(recorded):
    _, rec, _, _ = recorded
    meta = rec["meta"]
    assert rec["format"] == FORMAT and rec["version"] == VERSION
    assert meta["device"] == "cpu" and meta["model"] == TINY and meta["threads"] >= 1
    assert meta["kernels"].startswith("kernels: ") and meta["recorded_at"][:4].isdigit()
    times = [e["t"] for e in rec["events"]]
    assert times == sorted(times) and times[-1] == meta["seconds"] > 0
    assert recording.label(meta).startswith("recorded on cpu")


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda r: r.update(version=VERSION + 1),
            f"recording version {VERSION + 1} is not supported; this build plays version {VERSION}",
        ),
        (lambda r: r.update(version=0), "recording version 0 is not supported"),
        (lambda r: r.update(format="something-else"), "not a recording (format 'something-else')"),
        (lambda r: r.update(events=[]), "non-empty event list"),
        (lambda r: r["events"].pop(0), "must begin with 'start'"),
        (lambda r: r["events"][3].pop("t"), "its time 't'"),
    ],
)
def test_files_this_build_cannot_play_are_refused_naming_why(recorded, tmp_path, change, words):
    _, rec, _, _ = recorded
    bad = copy.deepcopy(rec)
    change(bad)
    path = recording.save(bad, tmp_path / "bad.json")
    with pytest.raises(RecordingError) as info:
        recording.load(path)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_results_file_or_garbage_is_refused(tmp_path):
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"model": TINY, "strategies": {}}))
    with pytest.raises(RecordingError, match="bench run --json results file"):
        recording.load(results)
    junk = tmp_path / "junk.json.gz"
    junk.write_bytes(gzip.compress(b"not json at all"))
    with pytest.raises(RecordingError, match="not JSON"):
        recording.load(junk)
    with pytest.raises(RecordingError, match="damaged gzip"):
        recording.parse(b"\x1f\x8b\x08\x00garbage", "x.gz")


def test_paced_playback_keeps_the_recorded_gaps_and_stops_when_asked(recorded):
    import time

    _, rec, _, _ = recorded
    short = {**rec, "events": [{**e, "t": 0.3 * i} for i, e in enumerate(rec["events"][:4])]}
    t0 = time.monotonic()
    assert len(list(playback.paced(short, 2.0))) == 4  # 0.9 s of recorded time at x2
    assert time.monotonic() - t0 >= 0.44
    assert list(playback.paced(short, 0.0, lambda: True)) == []


def test_bench_record_and_run_record_write_recordings(tmp_path, capsys):
    out = tmp_path / "r.json.gz"
    assert (
        bench.main(
            [
                "record",
                "--model",
                TINY,
                "--scenario",
                "capitals",
                "--max-new-tokens",
                "3",
                "--out",
                str(out),
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    rec = recording.load(out)
    assert rec["meta"]["source"] == "bench record" and rec["meta"]["scenario"] == "capitals"
    assert rec["meta"]["specs"] == [expand(n, 64, 4, "exact", "step") for n in default_names()]  # the page's panes
    played = playback.fold(rec)
    results = json.loads((tmp_path / "r.json").read_text())
    assert played.result["strategies"].keys() == results["strategies"].keys()
    for label, r in results["strategies"].items():
        assert [reply.text for reply in played.lanes[label].replies] == r["turn_texts"], label
    run = tmp_path / "run.json"
    assert (
        bench.main(
            [
                "run",
                "--model",
                TINY,
                "--prompt",
                "hi",
                "--strategies",
                "full,window:budget=4",
                "--max-new-tokens",
                "3",
                "--record",
                str(run),
            ]
        )
        == 0
    )
    assert recording.load(run)["meta"]["source"] == "bench run"
    capsys.readouterr()
    assert bench.main(["record", "--model", TINY, "--out", "x.txt"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "ends in .json or .json.gz" in err and err.count("\n") == 1


def test_the_token_map_opens_on_the_most_telling_view(recorded):
    _, rec, _, _ = recorded
    played = playback.fold(rec)
    label, other, layer = views.telling_view(played, played.token_maps)
    diverged = [
        lbl
        for lbl in played.shown
        if played.lanes[lbl].divergence is not None and lbl.split(":")[0] not in ("full", "kvdirect", "anchorkv")
    ]
    if diverged:
        assert label in diverged
    assert other.startswith("anchorkv")
    tokens = played.token_maps[label]["tokens"]

    def key(j):  # (evicted tokens of the answer, evicted tokens) at layer j: the view maximises it
        states = recording.map_layer(played.token_maps, label, j)["states"]
        marked = views.marked_tokens(tokens[: len(states)], "4127")
        return sum(states[i] == "evicted" for i in marked), states.count("evicted")

    assert all(key(layer) >= key(j) for j in range(len(played.token_maps[label]["states"])))
    html = views.token_map_html(recording.map_layer(played.token_maps, label, layer), label, layer, mark="4127")
    assert html.count("kvd-expect") >= 1 and "“4127”" in html


# Every shipped recording's expectation, read by hand from its events (each lane's token ids over the `step` events
# for the first divergence from the full cache's, each `turn_end` event's texts for the words), written out here so
# that a recording is checked against what it holds, not against what the code folds it into:
#   ask: (turn, words) asked of every pane's reply at that turn (0-based), as a scenario's `expect` asks;
#   says: the panes whose reply at that turn contains the words;
#   diverge: each pane's first token (an index over the concatenated turns) that differs from the full cache's;
#     a pane not listed never differs;
#   meta: the expectation the file itself carries (the page's "says ...?" column), None where it carries none.
# The recall recording asks its scenario's question; the others carry no expectation of their own, so one is
# written here: the twenty-turn recording's turn 7 ("How far apart should I plant the tomatoes?"), where the full
# cache says "8-10 inches" and two baselines do not; the long document's last question, whose answer in the
# document is "ten seconds", which no pane of Gemma 3 270M says, the full cache included.
EXACT = {
    rebuild: (
        f"kvdirect:budget=64:mode=exact:rebuild={rebuild}",
        f"anchorkv:budget=64:spacing=30:mode=exact:rebuild={rebuild}",
    )
    for rebuild in ("step", "turn")
}
EXPECTED = {
    "recall-smollm2-135m": dict(
        ask=(7, "4127"),
        says={"full", *EXACT["step"]},
        meta=[7, "4127"],
        diverge={"h2o:budget=64": 48, "streaming_llm:budget=64": 51, "snapkv:budget=64": 87, "tova:budget=64": 87},
    ),
    "twenty-turns-smollm2-135m": dict(
        ask=(7, "8-10 inches"),
        says={"full", *EXACT["turn"], "streaming_llm:budget=64", "tova:budget=64"},
        meta=None,
        diverge={"h2o:budget=64": 29, "streaming_llm:budget=64": 35, "snapkv:budget=64": 29, "tova:budget=64": 29},
    ),
    "long-document-gemma3-270m": dict(
        ask=(4, "ten seconds"),
        says=set(),
        meta=None,
        diverge={"h2o:budget=64": 7, "streaming_llm:budget=64": 14, "snapkv:budget=64": 14, "tova:budget=64": 1},
    ),
}


def test_every_shipped_recording_is_offered_and_has_an_expectation():
    """A recording added without an expectation, or one the picker drops (`offered` skips files it cannot open),
    fails here instead of going unchecked."""
    assert set(recording.shipped()) == {name for _, name in playback.offered()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_shipped_recording_replays_to_the_figures_it_holds(name):
    """Every pane's replies, bytes and tokens as the recorded results hold them, and the expectation above.

    Mutations that fail it: `Session.says_expected` reading the last reply instead of the asked turn's
    (`lane.replies[-1]`): the recall recording asks its last turn, so the old test, which checked only recordings
    carrying an expectation, passed, while the twenty-turn recording's turn 7 now says otherwise; and
    `Session._step` recording a divergence one token late (`(turn, index + 1)`), which the old test, checking
    only that exact panes never diverge, let through."""
    want = EXPECTED[name]
    rec = playback.open_recording(name)
    meta = rec["meta"]
    for key in ("model", "device", "dtype", "threads", "kernels", "specs", "turns", "recorded_at", "commit", "command"):
        assert meta.get(key) is not None, key
    assert meta.get("expect") == want["meta"]
    played = playback.fold(rec)
    done = [e for e in rec["events"] if e["type"] == "done"][-1]["result"]
    steps = [e for e in rec["events"] if e["type"] == "step"]
    assert played.steps == len(steps) and played.user_turns == meta["turns"]
    ends = [e for e in rec["events"] if e["type"] == "turn_end"]
    assert len(ends) == len(meta["turns"])
    assert played.shown == meta["specs"] and {"full", *want["says"], *want["diverge"]} <= set(played.shown)
    for label in played.shown:
        lane = played.lanes[label]
        assert [r.text for r in lane.replies] == done["strategies"][label]["turn_texts"], label
        assert lane.turns == [e["bytes"][label] for e in ends], label
        assert [t for r in lane.replies for t in r.tokens] == done["strategies"][label]["token_ids"], label
        diverge = want["diverge"].get(label)
        assert played.first_divergence_index(label) == diverge == done["strategies"][label]["first_divergence"], label
    # What the scoreboard says is what the recorded results say, asked the expectation's question.
    turn, words = want["ask"]
    played.expect = (turn, words)
    assert {label for label in played.shown if played.says_expected(label)} == want["says"]
    for label in played.shown:
        assert played.says_expected(label) == (words in done["strategies"][label]["turn_texts"][turn]), label
    board = scoreboard_html(played)
    assert "recorded on" in board and f"says {words}?" in board
    assert board.count('kvd-good">✓') == len(want["says"])
    assert board.count('kvd-bad">✗') == len(played.shown) - len(want["says"])


# --- the page's handlers: replay, a message after a recording, the hosted time budget ---------------------------
@pytest.fixture(scope="module")
def handlers(app):
    """The handlers of the app launched once per process (conftest's `app`), called directly."""
    return app[0].kvd_handlers


def controls(**overrides) -> dict:
    values = dict(
        model=TINY,
        custom_model="",
        device="auto",
        dtype="float32",
        strategies=["full", "window"],
        extra_specs="",
        budget=8,
        spacing=2,
        mode="exact",
        rebuild="turn",
        max_new_tokens=4,
        twins=True,
    )
    values.update(overrides)
    return values


def status_of(update: dict) -> str:
    return next(str(v) for c, v in update.items() if getattr(c, "elem_id", None) == "kvd-status")


def test_replaying_folds_the_file_and_a_message_then_starts_a_new_conversation(handlers, recorded):
    _, rec, _, path = recorded
    session = Session()
    final = list(handlers.replay(session, None, "instant", str(path)))[-1]
    assert "Replayed:" in status_of(final) and session.recording is not None and not session.busy
    assert lanes_of(session) == lanes_of(playback.fold(rec))
    # Sending a message does not continue the recorded conversation: it starts a new one, live.
    final = list(handlers.send(session, "Hello.", **controls()))[-1]
    assert "Done: 1 turn(s)" in status_of(final), status_of(final)
    assert session.recording is None and session.user_turns == ["Hello."]


def test_a_hosted_run_stops_at_its_time_budget_and_says_so(handlers, monkeypatch):
    from kvdirect_app.app.ui import turn_buttons
    from kvdirect_app.plain import limits as limits_module

    monkeypatch.setattr(turn_buttons, "limits", lambda: limits_module.Limits(run_seconds=0.0))
    session = Session()
    final = list(handlers.send(session, "Tell me a story.", **controls(max_new_tokens=40)))[-1]
    message = status_of(final)
    assert "time budget (0 s per run)" in message and "what was produced is shown" in message, message
    steps = session.steps
    assert 1 <= steps < 40 and not session.busy
    # Without the budget the same run goes on to its token limit (or its end of reply): the stop was the budget's.
    monkeypatch.setattr(turn_buttons, "limits", lambda: limits_module.Limits())
    unbounded = Session()
    list(handlers.send(unbounded, "Tell me a story.", **controls(max_new_tokens=40)))
    assert unbounded.steps > steps


def test_the_expected_wait_is_the_median_of_the_last_runs_capped_by_the_budget(monkeypatch):
    from kvdirect_app.app.ui import line as line_module
    from kvdirect_app.plain import limits as limits_module

    line = line_module.Line()
    monkeypatch.setattr(line_module, "limits", lambda: limits_module.Limits())
    assert line.expected_wait(1, 1) == " Your run starts when they finish."  # nothing measured, no budget
    line.took = [10.0, 30.0, 20.0]
    assert "about 40 s (the last 3 run(s) took about 20 s each)" in line.expected_wait(1, 1)
    monkeypatch.setattr(line_module, "limits", lambda: limits_module.Limits(run_seconds=15.0))
    assert "about 45 s" in line.expected_wait(2, 1) and "stops after 15 s" in line.expected_wait(2, 1)
    line.started()
    line.ended()
    assert len(line.took) == 4 and line.took[-1] < 1.0  # a run's own duration is what is kept


def test_a_visitor_state_starts_as_a_name_and_unfolds_when_a_handler_needs_it(handlers):
    import copy as _copy

    from kvdirect_app.app.ui import layout

    first = layout.first_screen()
    session = Session(pending=playback.first_name())
    assert len(repr(_copy.deepcopy(session))) < 2_000  # what Gradio copies for each visitor: no events
    label, other, layer = views.telling_view(first, first.token_maps)
    html, attention = handlers.token_map(session, label, layer, other)
    assert session.pending is None and session.recording == first.recording
    assert lanes_of(session) == lanes_of(first)
    assert "recorded on" in html and html.count("kvd-map-head") == 2
    # The shipped recall recording carries the attention snapshot: the full cache and the strategy, its evicted
    # tokens marked, "recorded on" in the title.
    names = [trace.name for trace in attention.data]
    assert names[:2] == ["Full KV cache", views.title(label)] and any(n.startswith("evicted by") for n in names)
    assert "recorded on" in attention.layout.title.text


def test_the_scoreboard_tells_speeds_as_seen_and_own_times_that_add_up(recorded):
    """The last row's rate is the one every pane streamed at, from the turn's first token to its last as the page
    received them (the recorded times); each pane's own ms/step, with the steps it sat out counted as 0, adds up
    to the row's "panes' own"; no pane claims a tokens-per-second of its own.  Catches: an "own tok/s" column (a
    speed nobody saw), a rate from the engine's step time instead of the tokens' arrival.  (Lanes that end their
    replies at different steps, where the old column's sum missed, are SmolLM2's: tests/app/test_browser.py.)"""
    live, rec, _, _ = recorded
    board = scoreboard_html(live)
    own = [float(ms) for ms in re.findall(r'<td class="kvd-num">(\d+)</td><td class="kvd-num">\d+%</td></tr>', board)]
    assert len(own) == len(live.shown)
    told = float(re.search(r"panes&#x27; own (\d+)", board)[1])
    assert abs(sum(own) - told) <= len(own) / 2 + 0.5
    last_turn = max(e["turn"] for e in rec["events"] if e["type"] == "step")
    steps = [e["t"] for e in rec["events"] if e["type"] == "step" and e["turn"] == last_turn]
    rate = (len(steps) - 1) / (steps[-1] - steps[0])
    assert re.search(r'kvd-seen"><b>([\d.]+) tok/s', board)[1] == f"{rate:.1f}"
    assert board.count("tok/s") == 1


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "the file is empty"),
        (b"  \n", "the file is empty"),
        (bytes(range(256)), "not a text file (it holds binary data)"),
        (b"[1, 2, 3]", "the file holds a list, not an object"),
        (b'"text"', "the file holds a string, not an object"),
        (b"{not json", "not JSON (line 1, column 2"),
    ],
)
def test_an_upload_that_is_not_a_recording_is_told_in_the_visitors_words(data, words):
    """The reviewer's four uploads (empty, binary, a list; and broken JSON): what the visitor did and what was
    expected, never an exception's class name ("JSONDecodeError", "UnicodeDecodeError") or a field's ("format
    'list'")."""
    with pytest.raises(RecordingError) as info:
        recording.parse(data, "mine.json")
    said = str(info.value)
    assert words in said and "expected a recording" in said and "\n" not in said
    assert "Error" not in said and "format 'list'" not in said
