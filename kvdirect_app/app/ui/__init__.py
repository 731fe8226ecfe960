"""The Studio web UI (Gradio): a thin client of the engine that never imports torch.

Gradio is imported when the page is built (`build_demo`), not with this package: the CLI reads the page's
settings (`ui.settings`) and must not pay gradio's import (~5 s here) on every start.
"""

from __future__ import annotations

__all__ = ["build_demo", "launch_options"]


def __getattr__(name: str):
    if name == "build_demo":
        from .layout import build_demo

        return build_demo
    raise AttributeError(f"module 'kvdirect_app.app.ui' has no attribute {name!r}")


def launch_options() -> dict:
    """Theme, CSS and the upload cap for `demo.launch(...)` (Gradio 6 takes them there, not in `Blocks`).

    `max_file_size`: Gradio's upload route refuses a larger file itself (HTTP 413) while it streams in, before any
    of our code reads it: the largest file the page opens (`jsonfile.MAX_BYTES`, a recording or a tasks result),
    and nothing at all on a hosted demo, whose page opens no visitor's file."""
    import gradio as gr

    from ...plain.hosted import hosted
    from ...plain.jsonfile import MAX_BYTES
    from .layout import ASSETS

    # Local fonts only: the demo must render offline (no web fonts).
    theme = gr.themes.Default(
        primary_hue="blue", neutral_hue="slate", text_size=gr.themes.sizes.text_lg,
        font=["system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
    )
    # The styles are drawn for a light page (projectors wash out dark ones): drop the dark class if the OS asked for it.
    # A pane's chat keeps its last reply in view (the first screen's recording has eight turns; a live reply grows),
    # unless the visitor is reading it with the pointer on it.
    start = """() => {
      document.body.classList.remove('dark'); document.documentElement.classList.remove('dark');
      const stick = () => document.querySelectorAll('.block.kvd-chat').forEach(chat => {
        if (!chat.matches(':hover')) chat.scrollTop = chat.scrollHeight; });
      new MutationObserver(stick).observe(document.body, {childList: true, subtree: true, characterData: true});
    }"""
    return {"theme": theme, "css_paths": [ASSETS / name for name in ("studio.css", "claims.css")
                                                        if (ASSETS / name).is_file()], "js": start,
            "max_file_size": 0 if hosted() else MAX_BYTES}
