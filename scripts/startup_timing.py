"""Times `python app.py` from the process's start: page served, the recording's scoreboard on screen, model ready.

    .venv/bin/python scripts/startup_timing.py [--cold] [REPEATS]     (needs Debian's chromium: `make browser`)

Each repeat starts the app in a fresh process on a free port and opens it in headless Chromium at 1280x720;
prints, in seconds since the process started: the page served (HTTP 200), the first screen's scoreboard with
the recorded verdicts visible (and since the page was opened), and the status saying the model is ready (its
kernels proved).  `--cold` makes the first start load the model the first time (an empty model cache folder, so
the GGUF file is dequantised and a copy kept) and probe the kernels afresh (an empty probe folder); the next
starts then use both, as every start after the first does.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from playwright import sync_api  # noqa: E402

from tests.app.test_browser import ARGS, CHROMIUM  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(env: dict) -> dict:
    port = free_port()
    env = {**env, "GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1"}
    url = f"http://127.0.0.1:{port}/"
    t0 = time.monotonic()
    app = subprocess.Popen(
        [sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while True:
            try:
                if urllib.request.urlopen(url, timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.05)
            if app.poll() is not None:
                raise SystemExit(f"app.py exited with {app.returncode}")
        served = time.monotonic() - t0
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            opened = time.monotonic()
            page.goto(url)
            page.wait_for_function(
                "(document.querySelector('#kvd-board') || {innerText: ''}).innerText.includes('recorded on')",
                timeout=120_000,
                polling=20,
            )
            board = time.monotonic() - t0
            after_open = time.monotonic() - opened
            page.wait_for_function(
                "document.querySelector('#kvd-status').innerText.includes('ready')", timeout=600_000, polling=50
            )
            ready = time.monotonic() - t0
            browser.close()
    finally:
        app.terminate()
        app.wait(30)
    return {"served": served, "board": board, "after_open": after_open, "ready": ready}


def main(argv: list[str]) -> None:
    cold = "--cold" in argv
    repeats = int(next((a for a in argv if a.isdigit()), "2"))
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["KVDIRECT_MODEL_CACHE"] = cache  # empty: the first start dequantises and keeps a copy here
            env["KVDIRECT_PROBE_CACHE"] = os.path.join(cache, "probes")  # and probes the kernels, kept for the next
        for i in range(repeats):
            t = one_start(env)
            kind = "first start, model loaded the first time" if cold and i == 0 else "start with the kept copy"
            print(
                f"start {i + 1} ({kind}): page served {t['served']:.1f} s, recorded scoreboard on screen "
                f"{t['board']:.1f} s ({t['after_open']:.1f} s after the page was opened), model ready "
                f"{t['ready']:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
