"""KV-Direct Studio: the side-by-side web app (`make demo`, or `python app.py`; a Space runs the latter).

Listens on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 127.0.0.1:7860).
On a Space (or with KVDIRECT_HOSTED=1) it runs in hosted mode: presets only,
smaller caps (see kvdirect_app/hosted.py).
"""

import os
import threading

from kvdirect_app import service
from kvdirect_app.errors import UserError
from kvdirect_app.ui import build_demo, launch_options
from kvdirect_app.ui.runner import queue_options, session_capacity
from kvdirect_app.ui.settings import default_model


def _warm_up(name: str):
    """Load the default model while the page is being opened (it is cached and shared read-only)."""
    try:
        service.load(name, dtype="float32", device="auto")
    except UserError as e:
        print(f"warm-up: {e}")


if __name__ == "__main__":
    model = default_model()
    threading.Thread(target=_warm_up, args=(model,), daemon=True).start()
    demo = build_demo(model=model)
    demo.queue(**queue_options()).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        show_error=False,  # a visitor sees our one-line messages, never a traceback
        state_session_capacity=session_capacity(),
        **launch_options(),
    )
