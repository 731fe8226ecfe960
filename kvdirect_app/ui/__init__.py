"""The Studio web UI (Gradio): a thin client of the engine that never imports torch."""

from __future__ import annotations

from .layout import ASSETS, build_demo

__all__ = ["build_demo", "launch_options"]


def launch_options() -> dict:
    """Theme and CSS for `demo.launch(...)` (Gradio 6 takes them there, not in `Blocks`)."""
    import gradio as gr

    # Local fonts only: the demo must render offline (no web fonts).
    theme = gr.themes.Default(
        primary_hue="blue", neutral_hue="slate", text_size=gr.themes.sizes.text_lg,
        font=["system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
    )
    # The styles are drawn for a light page (projectors wash out dark ones): drop the dark class if the OS asked for it.
    light = "() => { document.body.classList.remove('dark'); document.documentElement.classList.remove('dark'); }"
    return {"theme": theme, "css_paths": [ASSETS / "studio.css"], "js": light}
