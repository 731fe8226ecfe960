"""Shared fixtures: models are loaded once per session (the loader caches them per process)."""

import contextlib
import os
import socket

import pytest

# Every results file the suite writes (bench run/sweep/reproduce/..., the compare endpoint), in this process or
# in a subprocess, is validated against its JSON Schema (docs/schema/) before it is written (kvdirect_app/schema.py).
os.environ["KVDIRECT_VALIDATE_JSON"] = "1"

from kvdirect_app.models import load_model

TINY_FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-olmo2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"]


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3():
    return load_model("gemma3-270m", dtype="float32", device="cpu")


def tiny(name: str, dtype: str = "float32"):
    return load_model(name, dtype=dtype, device="cpu")


def all_sliding(loaded) -> bool:
    """Every layer slides (tiny-mistral): such layers keep their window like the full cache, nothing is rebuilt."""
    from kvdirect_app.compat import layer_specs

    return all(spec.is_sliding for spec in layer_specs(loaded.config))


def bad_spec_error(text: str) -> str:
    """The StrategyError message for a bad spec, checked to be one line."""
    from kvdirect_app.strategies import StrategyError, parse_spec

    with pytest.raises(StrategyError) as info:
        parse_spec(text)
    message = str(info.value)
    assert "\n" not in message
    return message


@contextlib.contextmanager
def running_app(model: str, max_new_tokens: int):
    """The Studio launched on loopback and a gradio_client session on it, both closed afterwards."""
    import gradio_client

    from kvdirect_app.ui import build_demo

    demo = launch_local(build_demo(model=model, max_new_tokens=max_new_tokens))
    client = gradio_client.Client(demo.local_url, verbose=False)
    try:
        yield demo, client
    finally:
        client.close()
        demo.close()


def launch_local(demo):
    """Launch a Gradio app in-process on a free loopback port (the caller closes it)."""
    from kvdirect_app.ui import launch_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.queue(default_concurrency_limit=1).launch(
        server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options())
    return demo
