"""No code from the web, ever by default (issue 54, item 1).

The exploit this closes: a file sent to Gradio's upload route comes back with its server path, and naming that
path as a strategy ran it in the app's process.  Each test names a route a web request can take to a strategy
file or module (the compare API, the page's extra specs box, the page's handlers called over the API) and checks
that nothing runs: the "evil" files below write a marker file when imported, and the marker stays absent.  The
one way in is the operator's switch (`KVDIRECT_STRATEGY_DIR`), for files in that folder, on loopback only.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdirect_app.app.studio import loopback, serving
from kvdirect_app.plain import specs
from kvdirect_app.plain.hosted import hosted, misread
from kvdirect_app.strategies import StrategyError, parse_spec

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-llama"
REFUSED = "never taken from a web request"  # the words of the page's and the API's refusal


def evil(folder: Path, name: str = "evil.py") -> tuple[Path, Path]:
    """A strategy file that writes a marker file when it is imported: (the file, the marker)."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"{name}.ran"
    path = folder / name
    path.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from kvdirect_app.strategies.scored import Scored\nclass Evil(Scored):\n    pass\n"
    )
    return path, marker


def controls(**overrides) -> dict:
    values = dict(
        model=TINY,
        custom_model="",
        device="auto",
        dtype="float32",
        strategies=["full"],
        extra_specs="",
        budget=8,
        spacing=2,
        mode="exact",
        rebuild="step",
        max_new_tokens=2,
        twins=True,
    )
    return {**values, **overrides}


def status_of(result) -> str:
    """The status line among a `/send` call's outputs (the one that says how the run went)."""
    texts = [v for v in result if isinstance(v, str) and "kvd-status" in v]
    assert texts, "no status in the outputs"
    return texts[0]


def send(url: str, extra_specs: str) -> str:
    """The page's Send over the API (a session of its own) with `extra_specs` in the box; its status."""
    client = gradio_client.Client(url, verbose=False, download_files=False)
    try:
        return status_of(client.predict("Hi.", api_name="/send", **controls(extra_specs=extra_specs)))
    finally:
        client.close()


def compare_refused(client, strategies: str) -> str:
    with pytest.raises(AppError) as info:
        client.predict("Hi.", TINY, strategies, 8, 0, 2, api_name="/compare")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


@pytest.fixture
def allowed(monkeypatch, tmp_path):
    """The operator's switch on, as `studio.main` sets it on a loopback-bound server: files from one folder."""
    folder = tmp_path / "mine"
    folder.mkdir()
    monkeypatch.setattr(specs, "_SERVING", [folder.resolve()])
    return folder


# --- (a) the exploit, end to end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("switch", ["off", "on for the upload's own folder"])
def test_an_uploaded_file_named_in_compare_never_runs(app, tmp_path, monkeypatch, switch):
    """Upload a strategy file through Gradio's upload route (it answers with the server path), then name that path
    in `/compare`: refused in one line, the marker absent, even where the operator's folder holds the upload.
    Mutation: `compare_specs` without its file/module check -> the file ran (marker written)."""
    import httpx

    demo, client = app
    source, marker = evil(tmp_path / "attacker")
    answer = httpx.post(f"{demo.local_url}gradio_api/upload", files=[("files", ("results.py", source.read_bytes()))])
    uploaded = answer.json()[0]
    assert Path(uploaded).is_file() and uploaded.endswith(".py")
    if switch != "off":
        monkeypatch.setattr(specs, "_SERVING", [Path(uploaded).parent.resolve()])
    message = compare_refused(client, f"full,{uploaded}:Evil")
    assert "compare API runs registered strategies only" in message and "allowed:" in message, message
    assert not marker.exists()


# --- (b) a file already on disk ------------------------------------------------------------------------------------
def test_a_file_on_disk_or_a_module_named_in_compare_is_refused(app, tmp_path, allowed):
    """`/compare` refuses file and module specs with the switch on and the file inside its folder.  Mutation: as
    above."""
    _, client = app
    path, marker = evil(allowed)
    for strategies in (
        f"full,{path}:Evil",
        f"{path}:Evil:budget=4",
        "full,json.decoder:JSONDecoder",
        "full,/etc/passwd:Foo",
    ):
        assert "names a file or module" in compare_refused(client, strategies)
    assert not marker.exists()


def test_the_pages_box_refuses_files_and_modules_without_the_switch(app, tmp_path):
    """Send with a file spec in the extra specs box (the page's own handler, called over the API as any client
    can): the status says it is refused and names the switch; nothing is imported.  Mutation: the box's check in
    `Settings.specs` removed -> the serve policy is all that stands; with that also off (not serving, as in the
    CLI) the file ran."""
    demo, _ = app
    path, marker = evil(tmp_path)
    for spec in (f"{path}:Evil", "json.decoder:JSONDecoder", "/etc/passwd:Foo"):
        status = send(demo.local_url, spec)
        assert REFUSED in status and "KVDIRECT_STRATEGY_DIR" in status, status
    assert not marker.exists()


def test_the_pages_box_refuses_files_in_hosted_mode_even_with_the_switch(app, allowed, monkeypatch):
    """Hosted mode outranks the switch.  Mutation: `page_folder` ignoring hosted() -> the file ran."""
    demo, _ = app
    path, marker = evil(allowed)
    monkeypatch.setenv("KVDIRECT_HOSTED", "1")
    status = send(demo.local_url, f"{path}:Evil")
    assert REFUSED in status, status
    assert not marker.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_switch_on_a_bind_that_is_not_loopback_runs_as_hosted_and_refuses(tmp_path):
    """The app as `python app.py` starts it, bound to 0.0.0.0 (reached here only through 127.0.0.1) with the switch
    naming a folder that holds the evil file: one line at start says hosted mode is on, and the page's box and
    `/compare` refuse the file.  Mutation: `serving` not turning hosted mode on for a non-loopback bind -> the file
    ran."""
    folder = tmp_path / "mine"
    path, marker = evil(folder)
    port = free_port()
    env = {
        **os.environ,
        "GRADIO_SERVER_NAME": "0.0.0.0",
        "GRADIO_SERVER_PORT": str(port),
        "KVDIRECT_STRATEGY_DIR": str(folder),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("KVDIRECT_HOSTED", None)
    env.pop("SPACE_ID", None)
    code = (
        "import kvdirect_app.app.ui.settings as s; s.default_model = lambda: 'tiny-llama'; "
        "from kvdirect_app.app.studio import main; main()"
    )
    log = tmp_path / "app.log"
    with open(log, "w") as out:
        app = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 300
        while True:
            assert app.poll() is None, log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        status = send(url, f"{path}:Evil")
        assert REFUSED in status, status
        client = gradio_client.Client(url, verbose=False, download_files=False)
        compare_refused(client, f"full,{path}:Evil")
        client.close()
        assert "hosted mode is on: bound to 0.0.0.0" in log.read_text(), log.read_text()
        assert not marker.exists()
    finally:
        app.terminate()
        app.wait(30)


# --- (c) the switch on loopback ------------------------------------------------------------------------------------
def test_the_switch_runs_a_file_from_its_folder_and_refuses_any_other(app, tmp_path, allowed):
    """A copy of the example strategy in the allowed folder gets its pane (the turn ends in Done); a file outside
    the folder, one reached through a link inside it that points outside, one named with `..`, and a module are
    refused, and nothing of theirs runs.  Mutations: `refusal` without its folder check -> the outside files ran;
    `Path(source)` not resolved (links followed) -> the linked file ran."""
    demo, _ = app
    shutil.copy(ROOT / "examples" / "random_eviction.py", allowed / "random_eviction.py")
    status = send(demo.local_url, f"{allowed}/random_eviction.py:RandomEviction:budget=4:seed=1")
    assert "Done: 1 turn(s)" in status, status
    outside, marker = evil(tmp_path / "elsewhere")
    (allowed / "linked.py").symlink_to(outside)
    for spec, words in (
        (f"{outside}:Evil", "outside the strategy folder"),
        (f"{allowed}/linked.py:Evil", "outside the strategy folder"),
        (f"{allowed}/../elsewhere/evil.py:Evil", "outside the strategy folder"),
        ("json.decoder:JSONDecoder", "modules are not imported"),
    ):
        status = send(demo.local_url, spec)
        assert words in status and "KVDIRECT_STRATEGY_DIR" in status, (spec, status)
    assert not marker.exists()


@pytest.mark.check
def test_serving_policy_bounds_every_route_in_the_process(tmp_path, monkeypatch):
    """The process-wide rule behind the routes (`specs.serve`): serving with no folder refuses every file and
    module spec, whatever route calls `parse_spec`; with a folder, only .py files inside it load.  Mutation:
    `refusal` returning None while serving -> the file ran."""
    path, marker = evil(tmp_path / "mine")
    monkeypatch.setattr(specs, "_SERVING", [None])
    for spec in (f"{path}:Evil", "json.decoder:JSONDecoder"):
        with pytest.raises(StrategyError, match="do not run in this web app"):
            parse_spec(spec)
    monkeypatch.setattr(specs, "_SERVING", [(tmp_path / "other").resolve()])
    with pytest.raises(StrategyError, match="outside the strategy folder"):
        parse_spec(f"{path}:Evil")
    (tmp_path / "mine" / "notes.txt").write_text("x")
    (tmp_path / "mine" / "looks.py").symlink_to(tmp_path / "mine" / "notes.txt")
    monkeypatch.setattr(specs, "_SERVING", [(tmp_path / "mine").resolve()])
    with pytest.raises(StrategyError, match="outside the strategy folder"):  # a link to a file that is not .py
        parse_spec(f"{tmp_path}/mine/looks.py:Evil")
    assert not marker.exists()


# --- how the studio starts ---------------------------------------------------------------------------------------
@pytest.mark.check
@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", True),
        ("127.8.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.4", False),
        ("example.org", False),
    ],
)
def test_loopback_binds(host, expected):
    """Mutation: `is_loopback` replaced by `== "127.0.0.1"` -> the 127/8 and ::1 cases fail."""
    assert loopback(host) is expected


@pytest.mark.check
def test_the_switch_is_honoured_on_loopback_only_and_a_share_link_or_other_bind_is_hosted(tmp_path):
    """`studio.serving`: the folder on loopback; a share link or a bind to 0.0.0.0 turns hosted mode on (one line)
    and drops the folder; a missing folder, or one holding Gradio's upload folder, stops the start with one line.
    Mutations: `share` not read from GRADIO_SHARE -> no hosted mode with a share link; the upload-folder check
    removed -> an upload folder allowed."""
    folder = tmp_path / "mine"
    folder.mkdir()
    env = {"KVDIRECT_STRATEGY_DIR": str(folder), "GRADIO_TEMP_DIR": str(tmp_path / "uploads")}
    host, share, path, lines = serving(dict(env))
    assert (host, share, path) == ("127.0.0.1", False, folder.resolve()) and len(lines) == 1, lines
    for extra, where in (({"GRADIO_SHARE": "true"}, "a share link"), ({"GRADIO_SERVER_NAME": "0.0.0.0"}, "0.0.0.0")):
        environ = {**env, **extra}
        _, _, path, lines = serving(environ)
        assert path is None and environ["KVDIRECT_HOSTED"] == "1" and hosted(environ)
        assert where in lines[0] and "hosted mode is on" in lines[0] and "ignored in hosted mode" in lines[1], lines
    environ = {**env, "GRADIO_SERVER_NAME": "0.0.0.0", "KVDIRECT_HOSTED": "0"}  # an explicit "off" is overruled
    assert serving(environ)[2] is None and hosted(environ)
    with pytest.raises(SystemExit, match="no such folder"):
        serving({**env, "KVDIRECT_STRATEGY_DIR": str(tmp_path / "none")})
    with pytest.raises(SystemExit, match="holds Gradio's upload folder"):
        serving({**env, "GRADIO_TEMP_DIR": str(folder / "gradio")})
    assert serving({})[2:] == (None, [])
    assert "not understood, so hosted mode is on" in serving({"KVDIRECT_HOSTED": "enabled"})[3][0]


# --- (d) hosted() fails closed -------------------------------------------------------------------------------------
@pytest.mark.check
@pytest.mark.parametrize(
    "value, space, on",
    [
        ("1", "", True),
        ("true", "", True),
        ("YES", "", True),
        ("on", "", True),
        ("0", "x/y", False),
        ("false", "x/y", False),
        ("No", "x/y", False),
        ("off", "x/y", False),
        ("enabled", "x/y", True),
        ("y", "x/y", True),
        ("2", "x/y", True),
        ("enabled", "", True),
        ("", "x/y", True),
        ("", "", False),
        (" ", "", False),
    ],
)
def test_hosted_fails_closed(value, space, on):
    """An unknown value is hosted, and the start says so in one line.  Mutation: the old `in ON` test -> `enabled`,
    `y` and `2` were "not hosted"."""
    environ = {"KVDIRECT_HOSTED": value, "SPACE_ID": space}
    assert hosted(environ) is on
    line = misread(environ)
    understood = value.strip().lower() in ("", "1", "true", "yes", "on", "0", "false", "no", "off")
    assert (line is None) is understood, line
    if line:
        assert "not understood, so hosted mode is on" in line and "allowed:" in line and "\n" not in line


# --- (e) what no mode loads ----------------------------------------------------------------------------------------
@pytest.mark.check
@pytest.mark.parametrize("serving_folder", ["not serving (the CLI, the library)", "serving, no folder", "serving /etc"])
def test_a_file_that_is_not_python_is_refused_in_every_mode(monkeypatch, serving_folder):
    """`/etc/passwd:Foo` was imported as Python.  Mutation: the `.py` check in `refusal` removed -> it was read
    (a SyntaxError from importing it, not this line)."""
    if serving_folder != "not serving (the CLI, the library)":
        monkeypatch.setattr(specs, "_SERVING", [Path("/etc") if "/etc" in serving_folder else None])
    with pytest.raises(StrategyError) as info:
        parse_spec("/etc/passwd:Foo")
    message = str(info.value)
    assert "must be a Python file; allowed: PATH.py:ClassName" in message and "\n" not in message, message


@pytest.mark.check
def test_the_cli_and_library_still_load_files_and_modules_anywhere(tmp_path):
    """Not serving (no `specs.serve`), a file anywhere and a module load as before."""
    shutil.copy(ROOT / "examples" / "random_eviction.py", tmp_path / "mine.py")
    assert parse_spec(f"{tmp_path}/mine.py:RandomEviction:budget=4").spec().startswith(f"{tmp_path}/mine.py")
    assert not specs._SERVING
