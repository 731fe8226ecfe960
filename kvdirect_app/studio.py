"""The web app's entry point: `python app.py` (a checkout, a Space) and `kvdirect-studio` (an installed package).

Listens on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 127.0.0.1:7860).
On a Space (or with KVDIRECT_HOSTED=1) it runs in hosted mode: presets only,
smaller caps (see kvdirect_app/hosted.py).
"""

from __future__ import annotations

import os
import threading


def _warm_up(name: str):
    """Load the default model while the page is being opened (it is cached and shared read-only)."""
    from . import service
    from .errors import UserError

    try:
        service.load(name, dtype="float32", device="auto")
    except UserError as e:
        print(f"warm-up: {e}")


def main() -> None:
    from .ui import build_demo, launch_options
    from .ui.runner import queue_options, session_capacity
    from .ui.settings import default_model

    model = default_model()
    demo = build_demo(model=model)
    demo.queue(**queue_options()).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        show_error=False,  # a visitor sees our one-line messages, never a traceback
        state_session_capacity=session_capacity(),
        prevent_thread_lock=True,
        **launch_options(),
    )
    # The model loads once the page is served: launch() checks that its own URL answers within 3 s, and a load
    # beside it (torch's import holds the interpreter for seconds) made that check fail on a busy machine.
    threading.Thread(target=_warm_up, args=(model,), daemon=True).start()
    demo.block_thread()


if __name__ == "__main__":
    main()
