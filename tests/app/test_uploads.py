"""Uploads that cannot exhaust the server: Gradio's own cap on an upload, a gzip file inflated as a stream under a
cap, the size checked before a file is read, JSON nesting bounded, and no upload at all on a hosted demo."""

import json
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest

from kvdirect_app.app.ui import tasks_view
from kvdirect_app.plain import jsonfile, recording
from kvdirect_app.plain.recording import RecordingError
from kvdirect_app.plain.schema import SchemaError

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LIMIT = f"{jsonfile.MAX_BYTES // MIB} MiB"


def one_line(error) -> str:
    said = str(error.value)
    assert "\n" not in said and "Error" not in said and "Traceback" not in said, said
    return said


# --- a gzip bomb --------------------------------------------------------------------------------------------------
BOMB = f"""
import json, resource, sys, zlib
sys.path.insert(0, {str(ROOT)!r})
from kvdirect_app.plain import recording
packer, zeros = zlib.compressobj(9, zlib.DEFLATED, 31), bytes({MIB})
bomb = b"".join([packer.compress(zeros) for _ in range(1024)] + [packer.flush()])  # 1 GiB of zeros, ~1 MiB
del zeros
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    recording.parse(bomb, "bomb.json.gz")
    said = None
except recording.RecordingError as e:
    said = str(e)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
print(json.dumps({{"packed": len(bomb), "grown_mib": grown / 1024, "said": said}}))
"""


def test_a_gzip_bomb_is_refused_in_one_line_with_little_memory():
    """1 GiB of zeros in a ~1 MiB gzip file, parsed as an uploaded recording in a fresh process: refused once the
    inflated bytes pass the cap, with its peak memory grown by < 100 MiB (it grew by 2,050 MiB when the whole file
    was inflated first).  Mutations: `jsonfile.inflate` without its size check, or `recording.parse` using
    gzip.decompress again -> the peak grows past 1 GiB."""
    out = subprocess.run([sys.executable, "-c", BOMB], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["packed"] < 2 * MIB
    assert got["said"] and "\n" not in got["said"], got
    assert f"unzipped, the file holds more than {LIMIT}" in got["said"], got
    assert got["grown_mib"] < 100, got


def test_gzip_is_read_whole_when_small_and_damage_is_one_line():
    """A stream of two gzip members reads as gzip reads it; a cut file and a broken one are named damaged."""
    packed = zlib.compressobj(6, zlib.DEFLATED, 31)
    first = packed.compress(b'{"a": ') + packed.flush()
    second = zlib.compressobj(6, zlib.DEFLATED, 31)
    both = first + second.compress(b"[1, 2]}") + second.flush()
    assert jsonfile.inflate(both, "x.gz", "JSON") == b'{"a": [1, 2]}'
    for broken in (both[: len(first) - 4], b"\x1f\x8b\x08\x00garbage", b"\x1f\x8b\x08\x00" + bytes(6) + b"\xff" * 8):
        with pytest.raises(ValueError) as info:
            jsonfile.inflate(broken, "x.gz", "JSON")
        assert "x.gz: a damaged gzip file" in one_line(info)


# --- the size before a read ---------------------------------------------------------------------------------------
def test_a_file_over_the_limit_is_refused_before_a_byte_is_read(tmp_path, monkeypatch):
    """A sparse 100 MiB file opened as a recording (the page's upload handler) and as a tasks result: refused from
    its size, naming the limit, and never opened.  Mutation: `jsonfile.read` without its os.stat check -> opened."""
    from kvdirect_app.app.ui import playback

    big = tmp_path / "big.json.gz"
    with open(big, "wb") as f:
        f.truncate(100 * MIB)

    def never(*args, **kwargs):
        raise AssertionError("the file was opened before its size was checked")

    monkeypatch.setattr(jsonfile, "open", never, raising=False)  # the module's own `open`, the builtin's shadow
    with pytest.raises(RecordingError) as info:
        playback.open_recording(None, str(big))
    assert f"big.json.gz: the file is larger than {LIMIT}" in one_line(info)
    with pytest.raises(SchemaError) as info:
        tasks_view.load(big)
    assert f"big.json.gz: the file is larger than {LIMIT}" in one_line(info)


def test_a_file_larger_than_its_size_says_is_read_only_to_the_limit(tmp_path):
    """The read itself is bounded: a named pipe (its size is 0 to os.stat) fed 4 MiB, read with a cap of 3 bytes,
    is refused and closed after a few bytes, so its writer is cut off (a broken pipe) long before 4 MiB.
    Mutation: `f.read()` unbounded -> all 4 MiB read (then refused: the memory was spent)."""
    import threading

    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    written = []

    def write():
        try:
            with open(pipe, "wb", buffering=0) as f:
                for _ in range(1024):
                    written.append(f.write(b" " * 4096))
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    with pytest.raises(ValueError) as info:
        jsonfile.read(pipe, "pipe.json", "JSON", cap=3)
    writer.join(30)
    assert "pipe.json: the file is larger than" in one_line(info)
    assert sum(written) < 1 * MIB, sum(written)


# --- nesting ------------------------------------------------------------------------------------------------------
def nested(depth: int) -> bytes:
    return b'{"format": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [jsonfile.MAX_DEPTH + 1, 500, 100_000])
def test_deep_nesting_in_a_recording_is_one_line(depth):
    """Nested a little past the limit (json would parse it; what walks it later may not), a little deeper, and far
    past Python's recursion limit (json itself raised RecursionError): each one line naming the limit, gzip or not.
    Mutation: `jsonfile.parse` without `too_deep` -> depth 65 and 500 reach `check` ("not a recording")."""
    for data, name in ((nested(depth), "deep.json"), (zlib.compress(nested(depth), wbits=31), "deep.json.gz")):
        with pytest.raises(RecordingError) as info:
            recording.parse(data, name)
        assert f"{name}: lists and objects nested more than {jsonfile.MAX_DEPTH} deep" in one_line(info)


def test_deep_nesting_that_the_scan_misses_is_still_one_line(monkeypatch):
    """Should the scan before the parse miss a nesting, json's RecursionError is caught: one line, not a traceback.
    Mutation: the `except RecursionError` removed -> RecursionError escapes."""
    monkeypatch.setattr(jsonfile, "too_deep", lambda data, limit=jsonfile.MAX_DEPTH: False)
    with pytest.raises(RecordingError) as info:
        recording.parse(nested(100_000), "deep.json")
    assert f"nested more than {jsonfile.MAX_DEPTH} deep" in one_line(info)


def test_deep_nesting_in_a_tasks_file_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_bytes(b'{"tasks": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(SchemaError) as info:
        tasks_view.load(path)
    assert f"deep.json: lists and objects nested more than {jsonfile.MAX_DEPTH} deep" in one_line(info)


@pytest.mark.parametrize(
    "text, deep",
    [
        (b'{"a": "[[[[", "b": [1, [2]]}', 3),  # brackets inside a string do not count
        (b'{"a": "\\"[[[[", "b": []}', 2),  # nor after an escaped quote
        (b'{"a": "\\\\", "b": [[[]]]}', 4),  # an escaped backslash ends the string where json ends it
        (b'"unterminated [[[[', 0),
    ],
)
def test_the_depth_scan_skips_strings(text, deep):
    """Mutations: `_STRING` not taken out, or the escapes left in -> the brackets in the strings count."""
    assert not jsonfile.too_deep(text, deep)
    assert deep == 0 or jsonfile.too_deep(text, deep - 1)


def test_the_shipped_files_are_within_the_limits():
    for path in recording.shipped().values():
        assert recording.load(path)["format"] == recording.FORMAT
    for path in sorted(tasks_view.SHIPPED.glob("*.json")):
        assert tasks_view.load(path)["cells"]


# --- the server's own cap -----------------------------------------------------------------------------------------
def multipart(size: int, boundary: str, name: str = "big.json"):
    """A multipart body holding a `size`-byte file, made a MiB at a time (the test never holds it whole)."""
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
        "Content-Type: application/json\r\n\r\n"
    ).encode()
    block = b" " * MIB
    for start in range(0, size, MIB):
        yield block[: min(MIB, size - start)]
    yield f"\r\n--{boundary}--\r\n".encode()


def post_upload(url: str, size: int):
    import httpx

    boundary = uuid.uuid4().hex
    try:
        return httpx.post(
            f"{url.rstrip('/')}/gradio_api/upload",
            content=multipart(size, boundary),
            timeout=120,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError) as e:
        return e  # the server hung up mid-body: refused before it took the rest


def refused(answer) -> bool:
    return not hasattr(answer, "status_code") or (answer.status_code == 413 and "maximum allowed size" in answer.text)


def test_a_100_mib_upload_is_refused_by_the_server_itself(app):
    """Gradio's upload route, of the app as launched (`launch_options`), refuses a 100 MiB file as it streams in:
    413 "File size exceeded maximum allowed size", no code of ours reached; a small file still goes through.
    Mutation: `max_file_size` left out of `launch_options` -> the 100 MiB file is stored (200)."""
    demo, _ = app
    small = post_upload(demo.local_url, 1024)
    assert getattr(small, "status_code", None) == 200, small
    assert refused(post_upload(demo.local_url, 100 * MIB))


def test_a_hosted_demo_hides_and_refuses_every_upload(monkeypatch, tmp_path):
    """Hosted mode: the recording and tasks upload buttons are hidden, the server refuses even a 1 KiB upload, and
    the two handlers refuse a file sent anyway without reading it.  Mutations: either `visible=not hosted()` removed,
    `max_file_size` not 0 when hosted, or either handler's hosted() check removed -> that assert fails."""
    import gradio as gr

    from kvdirect_app.app.ui import launch_options
    from kvdirect_app.app.ui.recording_buttons import RecordingButtons
    from kvdirect_app.app.ui.session import Session
    from kvdirect_app.app.ui.sidebar import recordings_picker
    from kvdirect_app.app.ui.tasks_tab import tasks_tab

    monkeypatch.setenv("KVDIRECT_HOSTED", "1")
    with gr.Blocks() as page:
        _, _, upload = recordings_picker(Session())
        tasks_tab()
    by_id = {b.elem_id: b for b in page.blocks.values() if getattr(b, "elem_id", None)}
    assert upload.visible is False and by_id["kvd-tasks-upload"].visible is False
    assert launch_options()["max_file_size"] == 0
    page.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, **launch_options())
    try:
        assert refused(post_upload(page.local_url, 1024))
    finally:
        page.close()

    def unread(*args, **kwargs):
        raise AssertionError("a hosted demo read a visitor's file")

    monkeypatch.setattr(jsonfile, "read", unread)
    file = tmp_path / "mine.json"
    file.write_text("{}")
    buttons = RecordingButtons(
        None, seen=lambda *a: None, refuse=lambda session, message: iter([message]), render=None, run=None
    )  # the handler alone: what it uses stubbed
    said = list(buttons.replay(Session(), None, "instant", str(file)))
    assert len(said) == 1 and "Opening a recording file is off on this hosted demo" in said[0], said
    opened = next(f.fn for f in page.fns.values() if f.name == "opened")
    shown = opened(str(file), None, None, None, None)
    assert "opening a results file is off on this hosted demo" in shown[8], shown[8]
