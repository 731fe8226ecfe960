"""The web app as clients reach it: launched in-process (once per process: conftest's `app`), driven with
gradio_client."""

import json

import pytest

gradio_client = pytest.importorskip("gradio_client")

from gradio_client.exceptions import AppError  # noqa: E402

from kvdirect_app.app.ui.compare_api import compare_specs  # noqa: E402
from kvdirect_app.app.ui.settings import catalogue, default_names, expand  # noqa: E402
from kvdirect_app.engine.runner import Engine, run_to_end  # noqa: E402
from kvdirect_app.models.loading import load_model  # noqa: E402
from kvdirect_app.plain.scenarios import scenarios  # noqa: E402
from kvdirect_app.plain.schema import VERSIONS  # noqa: E402
from kvdirect_app.strategies import parse_specs  # noqa: E402

from ..runs import differences  # noqa: E402

TINY = "tiny-llama"
# Timings and process memory differ from run to run, and so do the bytes outside torch (Python's buffers a first
# call caches, the process's unattributed blocks); everything else must be identical.
VOLATILE = {
    "latency_ms",
    "tokens_per_s",
    "process_rss_peak_bytes",
    "threads",
    "shared_pass_ms_mean",
    "turn_seconds",
    "steps",
    "unattributed_bytes",
}
OUTSIDE = {"outside_torch", "outside_torch_between_turns"}


def stable(result: dict) -> dict:
    out = {k: v for k, v in result.items() if k not in VOLATILE}
    out["strategies"] = {
        label: {k: v for k, v in r.items() if k not in VOLATILE} for label, r in result["strategies"].items()
    }
    for r in out["strategies"].values():
        r["turns"] = [
            {k: v for k, v in t.items() if k != "decode_ms_per_token" and k not in OUTSIDE} for t in r["turns"]
        ]
        r["state_bytes"] = {k: v for k, v in r["state_bytes"].items() if k not in OUTSIDE}
    return out


def engine_result(model: str, specs: str, turns: list[str], max_new_tokens: int, raw: bool = False) -> dict:
    loaded = load_model(model, dtype="float32", device="auto")
    return run_to_end(Engine(loaded, parse_specs(specs), max_new_tokens=max_new_tokens, raw=raw), turns)


def outputs_of(demo, api_name: str) -> list:
    """The components whose values a client gets back, in order (buttons and layout blocks are skipped)."""
    fn = next(f for f in demo.fns.values() if f.api_name == api_name)
    return [c for c in fn.outputs if not getattr(c, "skip_api", False)]


def test_compare_endpoint_returns_the_bench_json(app):
    demo, client = app
    names = ",".join(default_names())
    got = client.predict("Tell me about caches.", TINY, names, 40, 0, 12, api_name="/compare")
    specs = compare_specs(names, 40, 0)
    want = engine_result(TINY, specs, ["Tell me about caches."], 12)
    assert (got.pop("schema"), got.pop("schema_version")) == ("kvdirect-studio/run", VERSIONS["run"])  # validated
    assert list(got["strategies"]) == [expand(n, 40) for n in default_names()]
    assert not differences(stable(got), stable(want)), differences(stable(got), stable(want))
    for label, r in got["strategies"].items():
        assert r["token_ids"] == want["strategies"][label]["token_ids"], label
    assert got["strategies"]["kvdirect:budget=40"]["kv_exact"] is True


def test_compare_fills_budget_and_spacing_only_where_declared(app):
    _, client = app
    specs = ",".join(n for n in ("full", "anchorkv", "window") if n in catalogue())
    got = client.predict("Hi.", TINY, specs, 5, 2, 4, api_name="/compare")
    for label in got["strategies"]:
        name = label.split(":")[0]
        assert ("budget=5" in label) == (name != "full"), label
        assert ("spacing=2" in label) == (name == "anchorkv"), label


def test_compare_on_smollm2_matches_the_engine(app):
    _, client = app
    got = client.predict(
        "What is the capital of France?", "smollm2-135m", "full,kvdirect:mode=exact", 16, 0, 10, api_name="/compare"
    )
    specs = compare_specs("full,kvdirect:mode=exact", 16, 0)
    assert specs == "full,kvdirect:mode=exact:budget=16"
    want = engine_result("smollm2-135m", specs, ["What is the capital of France?"], 10)
    assert (got.pop("schema"), got.pop("schema_version")) == ("kvdirect-studio/run", VERSIONS["run"])
    assert not differences(stable(got), stable(want)), differences(stable(got), stable(want))
    assert got["strategies"]["kvdirect:mode=exact:budget=16"]["token_ids"] == want["strategies"]["full"]["token_ids"]


@pytest.mark.parametrize(
    "strategies, words",
    [("kvdirect:budget=0", "budget"), ("nonsense", "unknown strategy"), ("kvdirect:colour=red", "unknown setting")],
)
def test_compare_bad_strategy_is_one_clear_error(app, strategies, words):
    _, client = app
    with pytest.raises(AppError, match=words) as info:
        client.predict("Hi.", TINY, strategies, 8, 0, 4, api_name="/compare")
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


def test_compare_unknown_model_is_one_clear_error_and_the_app_stays_up(app):
    _, client = app
    with pytest.raises(AppError, match="unknown model") as info:
        client.predict("Hi.", "no-such-model", "full", 8, 0, 4, api_name="/compare")
    assert "\n" not in str(info.value)
    assert client.predict("Hi.", TINY, "full", 8, 0, 2, api_name="/compare")["strategies"]["full"]["token_ids"]


def _controls(**overrides) -> dict:
    values = dict(
        model=TINY,
        custom_model="",
        device="auto",
        dtype="float32",
        strategies=default_names(),
        extra_specs="",
        budget=40,
        spacing=2,
        mode="exact",
        rebuild="step",
        max_new_tokens=4,
        twins=True,
    )
    values.update(overrides)
    return values


def test_scenario_plays_to_the_end_and_exports_what_the_engine_gives(app):
    demo, client = app
    table = scenarios()
    turns = table["capitals"]["turns"]
    final = client.predict(scenario="capitals", api_name="/play_scenario", **_controls())
    outputs = outputs_of(demo, "play_scenario")
    by_id = {c.elem_id: v for c, v in zip(outputs, final) if c.elem_id}
    assert f"Done: {len(turns)} turn(s)" in by_id["kvd-status"]
    chats = [v for c, v in zip(outputs, final) if "kvd-chat" in (c.elem_classes or [])]
    filled = [chat for chat in chats if isinstance(chat, list) and chat]  # hidden panes get no update
    assert len(filled) == len(default_names())
    for chat in filled:
        assert len(chat) == 2 * len(turns)
        assert [m["role"] for m in chat[:2]] == ["user", "assistant"]
    downloads = [v for c, v in zip(outputs, final) if type(c).__name__ == "DownloadButton"]
    paths = [d["value"] for d in downloads]  # updates {"value": path, "interactive": True}
    assert [p.rsplit(".", 1)[-1] for p in paths] == ["gz", "json", "csv", "csv", "html"]
    exported = json.loads(open(paths[1]).read())
    specs = ",".join(expand(n, 40, 2, "exact", "step") for n in default_names())
    want = engine_result(TINY, specs, turns, 4)
    assert exported["user_turns"] == turns
    assert not differences(stable(exported["results"]), stable(want)), differences(
        stable(exported["results"]), stable(want)
    )
    rows = exported["steps"]
    assert {r["strategy"] for r in rows} == set(want["strategies"])
    # The Export tab's recording plays back to the same results and the same step rows.
    from kvdirect_app.app.ui.playback import fold
    from kvdirect_app.plain.recording import load

    recorded = load(paths[0])
    assert recorded["meta"]["source"] == "app" and recorded["meta"]["scenario"] == "capitals"
    assert recorded["meta"]["turns"] == turns
    played = fold(recorded)
    assert stable(played.result) == stable(want)
    assert played.step_rows() == rows


def test_a_scenario_too_long_for_the_model_shows_one_message(app):
    demo, client = app
    final = client.predict(scenario="long-document", api_name="/play_scenario", **_controls())
    by_id = {c.elem_id: v for c, v in zip(outputs_of(demo, "play_scenario"), final) if c.elem_id}
    assert "context" in by_id["kvd-status"]
    # The app is still up and plays the next request.
    final = client.predict(scenario="capitals", api_name="/play_scenario", **_controls(max_new_tokens=2))
    by_id = {c.elem_id: v for c, v in zip(outputs_of(demo, "play_scenario"), final) if c.elem_id}
    assert "Done: 3 turn(s)" in by_id["kvd-status"]


def test_send_continues_the_conversation_and_settings_changes_replay(app):
    demo, _ = app
    client = gradio_client.Client(demo.local_url, verbose=False, download_files=False)  # a session of its own
    outputs = outputs_of(demo, "send")
    chat_index = next(i for i, c in enumerate(outputs) if "kvd-chat" in (c.elem_classes or []))
    first = client.predict("Hello.", api_name="/send", **_controls(strategies=["full", "kvdirect"]))
    second = client.predict("And then?", api_name="/send", **_controls(strategies=["full", "kvdirect"]))
    assert len(first[chat_index]) == 2 and len(second[chat_index]) == 4
    assert second[chat_index][:2] == first[chat_index][:2]
    # A new budget rebuilds the engine and replays both turns: greedy, so the same tokens.
    third = client.predict("Once more.", api_name="/send", **_controls(strategies=["full", "kvdirect"], budget=3))
    assert third[chat_index][:4] == second[chat_index]
    bad = client.predict("Hi.", api_name="/send", **_controls(extra_specs="kvdirect:mode=sideways"))
    status = next(v for c, v in zip(outputs, bad) if c.elem_id == "kvd-status")
    assert "mode" in status and "allowed" in status
    client.close()


def test_on_zero_gpu_every_turn_rebuilds_and_replays_the_conversation(app, monkeypatch):
    demo, _ = app
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")  # no engine outlives a call there
    client = gradio_client.Client(demo.local_url, verbose=False, download_files=False)
    outputs = outputs_of(demo, "send")
    chat_index = next(i for i, c in enumerate(outputs) if "kvd-chat" in (c.elem_classes or []))
    map_index = next(i for i, c in enumerate(outputs) if c.elem_id == "kvd-token-map")
    controls = _controls(strategies=["full", "kvdirect"], budget=3)
    first = client.predict("Hello.", api_name="/send", **controls)
    second = client.predict("And then?", api_name="/send", **controls)
    assert len(second[chat_index]) == 4 and second[chat_index][:2] == first[chat_index][:2]
    assert "kvd-tok" in second[map_index]  # the token map came back with the run
    client.close()


def test_the_frontier_tab_draws_a_point_per_strategy_and_setting(app):
    demo, client = app
    status, plot = client.predict(
        source="capitals",
        api_name="/frontier",
        **_controls(strategies=["full", "kvdirect", "anchorkv", "window"], max_new_tokens=3),
    )
    assert "points from 2 runs" in status
    figure = json.loads(plot["plot"])
    points = {text[0] for trace in figure["data"] if trace.get("mode") == "markers" for text in trace["customdata"]}
    # KV-Direct and the window at budgets 16 and 64; AnchorKV at its deepest spacing in both rebuild modes and at
    # its break-even spacing (1 for this model, with the token-id anchor)
    want = {
        f"{spec}:budget={b}{tail}"
        for b in (16, 64)
        for spec, tail in (("kvdirect", ":mode=exact:rebuild=step"), ("window", ""))
    }
    want |= {
        f"anchorkv:spacing={s}:budget={b}:rebuild={r}"
        for b in (16, 64)
        for s, r in ((4, "step"), (4, "turn"), (1, "step"))
    }
    assert points == want
    assert any(t.get("name") == "Pareto front" for t in figure["data"])


def test_kernels_setting_reaches_the_run_its_status_and_the_compare_endpoint(app):
    """The page's Kernels radio and the compare endpoint's `kernels` choose the run's kernels, the status line
    says which ran, and a bad value gets its one-line message."""
    demo, client = app
    outputs = outputs_of(demo, "send")
    status = next(i for i, c in enumerate(outputs) if c.elem_id == "kvd-status")
    for kernels in ("native", "invariant"):
        out = client.predict("Say hi.", api_name="/send", **_controls(kernels=kernels, strategies=["full", "kvdirect"]))
        assert "Done: " in out[status] and f"kernels: {kernels}" in out[status], out[status]
    # Through the API Gradio's radio refuses an unknown choice itself (naming the allowed ones); the handlers'
    # own check (a caller of the handlers, or a radio without that check) names the setting too.
    with pytest.raises(AppError, match=r"not in the list of choices: \['invariant', 'native'\]"):
        client.predict("Say hi.", api_name="/send", **_controls(kernels="turbo"))
    from kvdirect_app.app.ui.settings import Settings
    from kvdirect_app.plain.limits import SettingError

    with pytest.raises(SettingError, match="kernels: 'turbo' is not allowed; allowed: invariant, native"):
        Settings.from_controls(_controls(kernels="turbo"))
    for kernels in ("native", "invariant"):
        result = client.predict("Hi.", TINY, "full,kvdirect", 4, 0, 3, "auto", "float32", kernels, api_name="/compare")
        assert result["kernels"]["mode"] == kernels and result["strategies"]["kvdirect:budget=4"]["kv_exact"] is True
    with pytest.raises(AppError, match="kernels: 'fastest' is not allowed"):
        client.predict("Hi.", TINY, "full", 4, 0, 2, "auto", "float32", "fastest", api_name="/compare")


# --- long and stopped turns, replays over a live conversation, the status line (handlers driven directly) ---------
def _status(demo, update: dict) -> str:
    """The status line's text (its HTML's tags dropped)."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", str(update.get(demo.kvd_handlers.s.views.status, ""))))


def _statuses(demo, updates) -> list[str]:
    return [s for s in (_status(demo, u) for u in updates) if s]


def test_a_long_message_asks_first_with_its_time_and_memory_and_a_second_send_runs_it(app, monkeypatch):
    """Mutations: `send` passes `ask=None` always (the long run starts unasked), or `load_model` keeps
    `session.asked` (after another action the next Send runs without asking)."""
    from kvdirect_app.app.ui import runner, turn_buttons
    from kvdirect_app.app.ui.session import Session

    demo, _ = app
    h = demo.kvd_handlers
    monkeypatch.setattr(turn_buttons, "LONG_PROMPT_TOKENS", 5)  # every message of this test is "long"
    monkeypatch.setattr(runner, "PACES", {})  # nothing measured yet in this process
    session, controls = Session(), _controls(strategies=["full", "kvdirect"])
    asked = _statuses(demo, h.send(session, "Tell me about caches.", **controls))[-1]
    assert "Press Send again to go on" in asked and "more than 5)" in asked, asked
    assert "time not known yet" in asked and "memory guard's estimate" in asked, asked
    assert session.user_turns == [] and session.engine is None and not session.busy
    done = _statuses(demo, h.send(session, "Tell me about caches.", **controls))[-1]
    assert "Done: 1 turn(s)" in done and session.user_turns == ["Tell me about caches."], done
    # The next long message is estimated from what the first one measured here; another action (choosing the
    # model again) cancels the question.
    asked = _statuses(demo, h.send(session, "And then?", **controls))[-1]
    assert "Press Send again" in asked and "a step, measured here with these settings" in asked, asked
    assert (
        "ready"
        in _statuses(demo, h.load_model(session, model=TINY, custom_model="", device="auto", dtype="float32"))[-1]
    )
    asked = _statuses(demo, h.send(session, "And then?", **controls))[-1]
    assert "Press Send again" in asked and session.user_turns == ["Tell me about caches."], asked


def test_stop_names_the_step_it_ends_after_and_the_status_never_shows_a_later_one(app, monkeypatch):
    """Mutation: `stop` sets the flag without `Pump.stop_after` (the status counts on past the step it named).

    The engine's thread runs ahead of the page (the tiny model makes 64 steps in less than the page's 0.5 s
    between updates on a fast machine), so it waits after its fourth step until Stop was pressed: the stop
    lands in the middle of the turn on every machine."""
    import re
    import threading

    import gradio as gr

    from kvdirect_app.app.ui import runner
    from kvdirect_app.app.ui.session import Session

    pressed, play = threading.Event(), runner.play

    def held(*args, **kwargs):
        events = play(*args, **kwargs)
        try:
            for event in events:
                yield event
                if event["type"] == "step" and event["index"] >= 3:
                    pressed.wait(60)
        finally:
            events.close()

    monkeypatch.setattr(runner, "play", held)
    demo, _ = app
    h = demo.kvd_handlers
    session = Session()
    run = h.send(session, "Tell me a long story.", **_controls(strategies=["full", "window"], max_new_tokens=64))
    before = []
    for update in run:
        before.append(_status(demo, update))
        if session.steps >= 3:
            break
    assert h.stop(session) == gr.skip()  # the turn says it, woken at once (its status line has one writer)
    pressed.set()
    after = _statuses(demo, run)
    n = re.search(r"Stopping after step (\d+) of turn 1…", after[0])
    assert n, after[0]
    n = int(n.group(1))
    assert after[-1] == f"Stopped after step {n} of turn 1.", after[-1]
    for text in after:
        assert all(int(k) <= n for k in re.findall(r"step (\d+)", text)), text
    assert 3 <= n < 64 and session.steps == n and not session.busy
    assert len(session.reference.replies[0].tokens) == n


def test_a_stop_asked_while_the_pump_hands_a_step_over_ends_after_the_step_it_named():
    """Stop can come after the pump took step 2 and before it checks: Stop names step 3 (the one the engine computes
    next) and the pump goes on to it.  Mutation: the pump stops at its next event whatever Stop named."""
    import threading

    from kvdirect_app.app.ui.runner import Pump

    ready, said = threading.Event(), []

    def events():
        ready.wait(timeout=60)
        yield {"type": "turn", "turn": 0, "chunk_ids": [1]}
        for i in range(10):
            yield {"type": "step", "index": i, "lanes": {"full": {"active": True}}}

    def should_stop():  # Stop pressed in the race's window, as its handler does it: the target first, then the flag
        if pump.step == 2 and not said:
            said.append(pump.stop_after())
        return bool(said)

    pump = Pump(events(), should_stop)
    ready.set()
    got = [event for event in pump if event is not None]
    assert said == [(1, 3)] and got[-1]["index"] + 1 == 3


def test_the_status_shows_the_time_while_a_long_message_is_read_and_no_event_comes(app, monkeypatch):
    """A piece of a long message takes minutes and sends nothing: the pump's tick redraws the status with the tokens
    read, their total and the time.  Mutation: `Pump.__iter__` waits without `tick` (no status until the piece ends)."""
    import threading

    from kvdirect_app.app.ui import runner, turn_buttons
    from kvdirect_app.app.ui.session import Session

    demo, _ = app
    h = demo.kvd_handlers
    real, reading = runner.play, threading.Event()

    def slow(
        config, turns, talk=None, rearrange=False
    ):  # the engine, stalled after a turn begins as if reading a long piece
        for event in real(config, turns, talk, rearrange):
            yield event
            if event["type"] == "turn":
                reading.wait(timeout=60)

    monkeypatch.setattr(runner, "play", slow)
    monkeypatch.setattr(turn_buttons, "HEARTBEAT_S", 0.01)
    session = Session()
    run = h.send(session, "Hello.", **_controls(strategies=["full", "kvdirect"]))
    for update in run:
        text = _status(demo, update)
        if "reading the message, 0 of" in text and "so far" in text and len(update) == 1:  # the tick's own redraw
            break
    reading.set()
    assert "Done: 1 turn(s)" in _statuses(demo, run)[-1]


def test_progress_says_tokens_read_steps_made_and_the_time_left_from_this_turns_speed(monkeypatch):
    """On a clock of its own: a first piece of 1,000 tokens read in 10 s leaves 2,000 at that rate; steps of 0.5 s
    leave the rest at theirs.  Mutation: the time left from the tokens read instead of those still to read."""
    from kvdirect_app.app.ui import runner
    from kvdirect_app.app.ui.settings import RunConfig

    monkeypatch.setattr(runner, "PACES", {})
    config = RunConfig(TINY, "cpu", "float32", ("full",), max_new_tokens=10)
    progress = runner.Progress(config)
    progress.add({"type": "turn", "turn": 1, "chunk_ids": [0] * 3000}, now=100.0)
    assert progress.line(100.0).startswith("reading the message, 0 of 3,000 tokens, 0 s so far, the time left is known")
    progress.add({"type": "prefill", "turn": 1, "done": 1000, "total": 3000}, now=110.0)
    assert progress.line(112.0) == "reading the message, 1,000 of 3,000 tokens, 12 s so far, about 20 s left to read it"
    progress.add({"type": "step", "index": 0, "step_ms": 500.0}, now=130.5)
    assert progress.line(131.0) == "step 1 of at most 10, 31 s so far, about 4 s left"
    # What this turn measured is the next estimate's basis: 10 ms a prompt token (30 s for 3,000), 0.5 s a step.
    assert runner.estimate_s(config, 100, 4)[0] == 100 * 0.01 + 4 * 0.5


def test_the_time_left_follows_steps_that_slow_as_the_context_grows(monkeypatch):
    """The reviewer's case: "about 2 s left" for 13 s while the steps slowed.  Steps of 100 + 20 i ms (each reads one
    token more), with +-15 ms of noise: after 10 of at most 40, the 30 left take 17.7 s; the estimate is within 10%
    of that (the mean of the steps so far said 5.7 s).  Steps that do not slow are not predicted to speed up.
    Mutation that fails it: the mean of all steps times the steps left."""
    from kvdirect_app.app.ui import runner
    from kvdirect_app.app.ui.settings import RunConfig

    monkeypatch.setattr(runner, "PACES", {})
    progress = runner.Progress(RunConfig(TINY, "cpu", "float32", ("full",), max_new_tokens=40))
    progress.add({"type": "turn", "turn": 0, "chunk_ids": [0] * 10}, now=0.0)
    for i in range(10):
        progress.add({"type": "step", "index": i, "step_ms": 100 + 20 * i + (15 if i % 2 else -15)}, now=1.0 + i)
    truth = sum(100 + 20 * i for i in range(10, 40)) / 1e3
    assert truth == pytest.approx(17.7)
    assert progress.steps_left_s(40) == pytest.approx(truth, rel=0.1)
    assert "about 18 s left" in progress.line(11.0), progress.line(11.0)
    flat = runner.Progress(RunConfig(TINY, "cpu", "float32", ("full",), max_new_tokens=40))
    flat.add({"type": "turn", "turn": 0, "chunk_ids": [0] * 10}, now=0.0)
    for i in range(10):
        flat.add({"type": "step", "index": i, "step_ms": 300 - 10 * i}, now=1.0 + i)
    assert flat.steps_left_s(40) == pytest.approx(30 * sum(300 - 10 * i for i in range(2, 10)) / 8 / 1e3)


def test_a_replay_asks_before_replacing_a_live_conversation(app):
    """Mutation: `replay` starts the recording without checking for live turns (the conversation is replaced at the
    first click)."""
    from kvdirect_app.app.ui import playback
    from kvdirect_app.app.ui.session import Session

    demo, _ = app
    h = demo.kvd_handlers
    session = Session()
    assert "Done: 1 turn(s)" in _statuses(demo, h.send(session, "Hello.", **_controls(strategies=["full"])))[-1]
    choice = playback.first_name()
    asked = _statuses(demo, h.replay(session, choice, "instant"))[-1]
    assert "Replaying would replace this conversation: its 1 live turn(s)" in asked, asked
    assert "Press ▶ Replay it again to replace it" in asked
    assert session.user_turns == ["Hello."] and session.recording is None
    assert "Replayed:" in _statuses(demo, h.replay(session, choice, "instant"))[-1]
    assert session.recording is not None
    # A recording on screen is no live conversation: the next replay asks nothing.
    assert "Replayed:" in _statuses(demo, h.replay(session, choice, "instant"))[-1]


def test_the_done_line_counts_the_steps_and_the_time_of_the_same_turn(app):
    """Two turns: the second's line gives its own steps (not both turns'), beside its own time.  Mutation: the line
    counts `session.steps` (every turn's steps) again."""
    import re

    from kvdirect_app.app.ui.session import Session

    demo, _ = app
    h = demo.kvd_handlers
    session, controls = Session(), _controls(strategies=["full", "kvdirect"], max_new_tokens=5)
    first = _statuses(demo, h.send(session, "Hello.", **controls))[-1]
    steps_first = session.steps
    assert re.match(rf"Done: 1 turn\(s\); turn 1: {steps_first} steps in [0-9.]+ s; ", first), first
    second = _statuses(demo, h.send(session, "And then?", **controls))[-1]
    assert session.steps > steps_first
    assert re.match(rf"Done: 2 turn\(s\); turn 2: {session.steps - steps_first} steps in [0-9.]+ s; ", second), second


def test_the_apps_torch_work_runs_on_its_one_compute_thread():
    """A turn's events and a conversation's engine are made on the compute thread (one long-lived thread: OpenMP
    keeps a team per thread that computed, and more teams than cores make libgomp's workers sleep after every op);
    called from the compute thread itself, `on_compute` runs in place instead of waiting on itself.  Mutation: the
    pump on a thread of its own per run (as before) fails the first check."""
    import threading

    from kvdirect_app.app.ui import runner

    where = []

    def events():
        where.append(threading.current_thread().name)
        yield {"type": "turn", "turn": 0, "chunk_ids": [1]}
        where.append(runner.on_compute(lambda: threading.current_thread().name))

    assert [e["type"] for e in runner.Pump(events(), lambda: False) if e is not None] == ["turn"]
    assert len(where) == 2 and all(name.startswith(runner.COMPUTE_THREAD) for name in where), where
    assert runner.on_compute(lambda: threading.current_thread().name).startswith(runner.COMPUTE_THREAD)


def test_a_conversations_roofline_is_this_machines_best_over_its_rows():
    """`Conversation.roofline` (the latency plot's line): the machine measured here once per process, dtype and
    thread count, the model's own weight bytes, over as many rows as the conversation's lanes."""
    import torch

    from kvdirect_app.app import engine_side, service
    from kvdirect_app.benchmarks import roofline

    talk = service.Conversation("tiny-llama", "cpu", "float32", ["full", "window:budget=4", "h2o:budget=4"], 2)
    roof = talk.roofline()
    assert roof["rows"] == 3 and roof["threads"] == talk.engine.threads
    weights = roofline.model_side(talk.engine.loaded)
    here = engine_side._machine(talk.engine.threads, torch.float32)
    assert roof == {
        **roofline.best_ms(
            weights["weight_bytes"], weights["params"], 3, here["gemm_gflops"]["float32"], here["bandwidth_gbs"]
        ),
        "gemm_gflops": here["gemm_gflops"]["float32"],
        "bandwidth_gbs": here["bandwidth_gbs"],
        "threads": talk.engine.threads,
    }
    assert roof["best_ms"] == max(roof["weights_read_ms"], roof["arithmetic_ms"]) > 0
