"""KV-Direct Studio: the side-by-side web app (`make demo`, or `python app.py`).

Listens on GRADIO_SERVER_NAME:GRADIO_SERVER_PORT (default 127.0.0.1:7860).
"""

import os
import threading

from kvdirect_app.models import ModelError, load_model
from kvdirect_app.ui import build_demo, launch_options
from kvdirect_app.ui.settings import DEFAULT_MODEL


def _warm_up(name: str):
    """Load the default model while the page is being opened (it is cached and shared read-only)."""
    try:
        load_model(name, dtype="float32", device="auto")
    except ModelError as e:
        print(f"warm-up: {e}")


if __name__ == "__main__":
    threading.Thread(target=_warm_up, args=(DEFAULT_MODEL,), daemon=True).start()
    demo = build_demo(model=DEFAULT_MODEL)
    demo.queue(default_concurrency_limit=1).launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        **launch_options(),
    )
