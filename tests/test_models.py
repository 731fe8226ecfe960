"""Model loading: presets, local folders, clear errors."""

import pytest
import torch

from kvdirect_app import models
from kvdirect_app.engine import Engine, run_to_end
from kvdirect_app.models import ModelError, load_model
from kvdirect_app.strategies import parse_specs


def test_tiny_models_are_seeded_and_shared():
    a = load_model("tiny-qwen3")
    assert load_model("tiny-qwen3") is a
    fresh = models._tiny("tiny-qwen3", models.presets()["tiny-qwen3"], torch.float32, torch.device("cpu"))
    for p, q in zip(a.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p, q)


def test_a_local_folder_loads_and_runs(tmp_path):
    tiny = load_model("tiny-llama")
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    local = load_model(str(tmp_path))
    assert local.source.startswith("local path")
    result = run_to_end(Engine(local, parse_specs("full,kvdirect:budget=2"), max_new_tokens=4), ["hi"])
    reference = run_to_end(Engine(tiny, parse_specs("full"), max_new_tokens=4), ["hi"])
    assert result["strategies"]["full"]["token_ids"] == reference["strategies"]["full"]["token_ids"]
    assert result["strategies"]["kvdirect:budget=2"]["kv_exact"] is True


def test_an_absent_embedded_package_names_the_fix(monkeypatch, tmp_path):
    # The "Hub copy" is a folder that does not exist, so nothing touches the network.
    missing = str(tmp_path / "nobody" / "no-such-model-xyz")
    table = dict(models.presets())
    table["ghost"] = {"kind": "gguf", "package": "no_such_package_xyz", "file": "x.gguf",
                      "hub_id": missing, "install": "pip install no-such-package-xyz"}
    monkeypatch.setattr(models, "presets", lambda: table)
    messages = []
    with pytest.raises(ModelError) as info:
        load_model("ghost", progress=messages.append)
    assert "install it: pip install no-such-package-xyz" in str(info.value)
    assert any(f"loading the Hub copy {missing} instead" in m for m in messages)


@pytest.mark.parametrize("name", ["", "   ", "not-a-preset"])
def test_unknown_or_empty_names_are_one_clear_line(name):
    with pytest.raises(ModelError) as info:
        load_model(name)
    assert "\n" not in str(info.value) and str(info.value).startswith("model: ")
