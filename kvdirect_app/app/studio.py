"""The web app's entry point: `python app.py` (a checkout, a Space) and `kvdirect-studio` (an installed package).

Listens on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 127.0.0.1:7860), with no share link unless
GRADIO_SHARE=true.  On a Space (or with KVDIRECT_HOSTED=1), bound to anything but loopback, or with a share link,
it runs in hosted mode: presets only, smaller caps, no strategy files (see kvdirect_app/plain/hosted.py).
KVDIRECT_STRATEGY_DIR=FOLDER lets the page's extra specs box name strategy files in FOLDER, on loopback only
(`serving`).
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
import threading
from pathlib import Path
from typing import MutableMapping

from ..plain.errors import UserError
from ..plain.hosted import ENV, ON, hosted, misread
from ..plain.specs import STRATEGY_DIR, serve
from . import service


def _warm_up(name: str):
    """Load the default model while the page is being opened (it is cached and shared read-only)."""
    try:
        service.load(name, dtype="float32", device="auto")
    except UserError as e:
        print(f"warm-up: {e}")


def loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def serving(environ: MutableMapping[str, str]) -> tuple[str, bool, Path | None, list[str]]:
    """(bind address, share link, the folder the page may load strategy files from, lines to print at start).

    Why the page refuses files by default: anything a web request names may be a file it uploaded a moment before
    (Gradio's upload route answers with the file's server path), so a page that loads a named file runs a
    stranger's code.  The operator's switch (`STRATEGY_DIR`) opts in one folder of their own, honoured only when
    nobody else can reach the page: a server bound to loopback with no share link.  Any other bind or a share
    link serves strangers, so it runs in hosted mode (set in `environ`, which worker processes inherit)."""
    host = environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    share = (environ.get("GRADIO_SHARE") or "").strip().lower() in ON
    lines = [line for line in [misread(environ)] if line]
    if (share or not loopback(host)) and not hosted(environ):
        environ[ENV] = "1"
        where = "a share link" if share else f"bound to {host}, not to loopback"
        lines.append(
            f"hosted mode is on: {where} serves strangers (presets only, smaller caps, no strategy files "
            "or modules); bind to 127.0.0.1 with no share link for the full studio"
        )
    folder = (environ.get(STRATEGY_DIR) or "").strip()
    if not folder:
        return host, share, None, lines
    if hosted(environ):
        lines.append(f"{STRATEGY_DIR} is ignored in hosted mode: the page runs registered strategies only")
        return host, share, None, lines
    path = Path(folder).resolve()
    if not path.is_dir():
        raise SystemExit(
            f"error: {STRATEGY_DIR}={folder}: no such folder; allowed: a folder of your strategy files (.py)"
        )
    uploads = Path(environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()
    if uploads.is_relative_to(path):
        raise SystemExit(
            f"error: {STRATEGY_DIR}={folder}: holds Gradio's upload folder ({uploads}), so an upload "
            "could be run; allowed: a folder of your own strategy files"
        )
    lines.append(
        f"{STRATEGY_DIR}: the page's extra specs box may name strategy files (.py) in {path}; nothing "
        "outside it, no modules, and never through the compare API"
    )
    return host, share, path, lines


def main() -> None:
    from .ui import build_demo, launch_options, runner, settings  # lazy: gradio (~5 s) loads after serving()

    host, share, folder, lines = serving(os.environ)
    for line in lines:
        print(line)
    serve(folder)  # from here on, a strategy file loads only from `folder`, whichever route names it
    model = settings.default_model()
    demo = build_demo(model=model)
    demo.queue(**runner.queue_options()).launch(
        server_name=host,
        share=share,
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        show_error=False,  # a visitor sees our one-line messages, never a traceback
        state_session_capacity=runner.session_capacity(),
        prevent_thread_lock=True,
        **launch_options(),
    )
    # The model loads once the page is served: launch() checks that its own URL answers within 3 s, and a load
    # beside it (torch's import holds the interpreter for seconds) made that check fail on a busy machine.
    threading.Thread(target=_warm_up, args=(model,), daemon=True).start()
    demo.block_thread()


if __name__ == "__main__":
    main()
