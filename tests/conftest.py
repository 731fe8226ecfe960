"""Shared fixtures: models are loaded once per session (the loader caches them per process)."""

import pytest

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
