"""AnchorKV and KV-Direct on the two embedded real models (a few spacings each)."""

from kvdirect_app.engine.runner import Engine
from kvdirect_app.models.prompts import filler_ids
from kvdirect_app.strategies import parse_specs


def _run(loaded, specs, first_ids, turns, max_new, park=False):
    engine = Engine(loaded, parse_specs(specs), max_new_tokens=max_new, raw=not loaded.chat)
    for _ in engine.turn(turns[0], ids=first_ids):
        pass
    for text in turns[1:]:
        if park:
            engine.park()
        for _ in engine.turn(text):
            pass
    return engine.results()


def _assert_exact(result):
    ref = result["strategies"]["full"]
    for spec, r in result["strategies"].items():
        assert r["token_ids"] == ref["token_ids"] and r["token_match"] == 1.0, spec
        assert r["kv_exact"] is True, spec
        assert r["state_bytes"]["formula_matches_measurement"], spec


def test_anchorkv_on_smollm2_with_park_and_resume(smollm2):
    specs = "full,anchorkv:spacing=2:budget=16,anchorkv:spacing=30:budget=16,anchorkv:spacing=7:budget=8:replay=naive"
    result = _run(smollm2, specs, None, ["Name three primary colours.", "Which one is the sky?"], 10, park=True)
    _assert_exact(result)
    parks = result["strategies"]["anchorkv:spacing=30:budget=16"]["parks"]
    assert parks[0]["bytes"] == 4 * parks[0]["seen"]  # token ids only


def test_gemma3_across_the_sliding_window(gemma3):
    first = filler_ids(gemma3.tokenizer, 600)  # longer than the 512-token window of the sliding layers
    specs = (
        "full,kvdirect:budget=32,anchorkv:spacing=6:budget=32,anchorkv:spacing=18:budget=32,"
        "anchorkv:anchors=dp:spacing=3:budget=32"
    )
    result = _run(gemma3, specs, first, ["(context)", "The harbour light was first lit in"], 8, park=True)
    _assert_exact(result)
    assert len(result["prompt_ids"]) == 600
