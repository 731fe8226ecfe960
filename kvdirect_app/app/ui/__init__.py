"""The Studio web UI (Gradio): a thin client of the engine that never imports torch.

Gradio is imported when the page is built (`build_demo`) or launched (`launch_options`), both in `layout`, not with
this package: the CLI reads the page's settings (`ui.settings`) and must not pay gradio's import (~5 s here) on every
start.
"""

from __future__ import annotations

__all__ = ["build_demo", "launch_options"]


def __getattr__(name: str):
    if name in __all__:
        from . import layout  # lazy: gradio's import (~5 s) waits for the page; the CLI reads ui.settings without it

        return getattr(layout, name)
    raise AttributeError(f"module 'kvdirect_app.app.ui' has no attribute {name!r}")
