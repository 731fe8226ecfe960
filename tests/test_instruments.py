"""The instruments observe the lanes and are timed apart; with them off, the engine does no measurement work; a
lane's attention time is its own call's."""

import json

import pytest

from kvdirect_app import lockstep
from kvdirect_app.engine import Engine, run_to_end
from kvdirect_app.instruments import COUNTS
from kvdirect_app.models import load_model
from kvdirect_app.prompts import filler_ids
from kvdirect_app.strategies import parse_specs

from .conftest import tiny

TURNS = ["Tell me about caches.", "Why do keys need positions?"]
SPECS = "full,kvdirect:budget=4,anchorkv:spacing=2:budget=3:rebuild=step,h2o:budget=6,window:budget=4"


def _counted(loaded, **options) -> tuple[dict, dict]:
    COUNTS.clear()
    result = run_to_end(Engine(loaded, parse_specs(SPECS), max_new_tokens=8, threads=1, **options), TURNS)
    return {name: n for name, n in COUNTS.items() if n}, result


@pytest.mark.check
def test_with_the_instruments_off_the_engine_does_no_measurement_work():
    """Instruments off: no comparison, digest, snapshot, storage count, trace, twin, agreement or RSS read ran,
    and the results say so; on (the default), each of them ran (so the count can see them), and a step's time
    adds up: the lanes' own + the instruments' + the unattributed rest."""
    loaded = tiny("tiny-llama")
    done, off = _counted(loaded, instruments=False)
    assert done == {}
    assert off["instruments"] == {"memory": "none", "compare": False, "twins": False, "agreement": False,
                                  "snapshots": False, "digests": False, "rss": False}
    assert off["steps"]["measurement_ms_mean"] == 0.0 and off["steps"]["measurement_by_instrument_ms_mean"] == {}
    for spec, r in off["strategies"].items():
        assert r["kv_digest"] is None and r["state_bytes"]["peak"] is None, spec
        assert r["teacher_forced_steps"] in (None, 0), spec
    assert off["strategies"]["kvdirect:budget=4"]["kv_exact"] is None  # nothing compared, nothing claimed

    done, on = _counted(loaded)
    assert {"compare", "digest", "snapshot", "storage", "rss", "agreement", "twins"} <= set(done), done
    assert "trace" not in done  # the default memory instrument is the storage count
    assert on["strategies"]["kvdirect:budget=4"]["kv_exact"] is True
    steps = on["steps"]
    assert steps["measurement_ms_mean"] > 0
    assert steps["wall_ms_mean"] == pytest.approx(steps["lanes_ms_mean"] + steps["measurement_ms_mean"]
                                                  + steps["unattributed_ms_mean"])
    # The same tokens either way: the instruments only observe.
    assert all(on["strategies"][s]["token_ids"] == off["strategies"][s]["token_ids"] for s in on["strategies"])

    done, _ = _counted(loaded, memory="trace")
    assert done["trace"] > 0 and done["storage"] > 0  # the trace, and the storage count it audits


def _run_ids(engine, ids):
    list(engine.turn("(a context of filler)", ids=ids))
    return engine.results()


def _attention(loaded, ids) -> dict:
    engine = Engine(loaded, parse_specs("full,window:budget=64"), max_new_tokens=6, threads=1, twins=False)
    result = _run_ids(engine, ids)
    return {label: r["latency_ms"]["decode_attention_ms_mean"] for label, r in result["strategies"].items()}


def test_a_lanes_attention_time_is_its_own_call(monkeypatch):
    """At a 1,000-token context a window of 64 attends over 64 keys, the full cache over 1,000: in one batched step
    each lane's attention is its own call, timed as its own, so the window's is well below half the full cache's.
    A mutation that shares one call's time equally between the lanes (what an equal split of a batched call
    reports) makes the check fail."""
    loaded = load_model("smollm2-135m")
    ids = filler_ids(loaded.tokenizer, 1000)
    own = _attention(loaded, ids)
    assert own["window:budget=64"] < 0.5 * own["full"], own

    original = lockstep.lanes_attention

    def split_equally(module, *args, **kwargs):
        rows = lockstep._LOCAL.batch.rows
        before = [row.attention_s for row in rows]
        out = original(module, *args, **kwargs)
        spent = sum(row.attention_s for row in rows) - sum(before)
        for row, b in zip(rows, before):
            row.attention_s = b + spent / len(rows)
        return out

    from transformers import AttentionInterface  # where the pass finds the registered function by name

    monkeypatch.setitem(AttentionInterface._global_mapping, lockstep.LANES_IMPLEMENTATION, split_equally)
    shared = _attention(loaded, ids)
    assert not shared["window:budget=64"] < 0.5 * shared["full"], shared


@pytest.mark.check
def test_the_cli_names_its_instruments_and_refuses_an_unknown_one(tmp_path, capsys):
    from kvdirect_app import bench

    out = tmp_path / "run.json"
    assert bench.main(["run", "--model", "tiny-llama", "--prompt", "Hi", "--max-new-tokens", "3", "--threads", "1",
                       "--strategies", "full,kvdirect:budget=2", "--no-instruments", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "memory instrument: none (formula only)" in printed and "measurement 0.0 (none)" in printed
    result = json.loads(out.read_text())
    assert not any(v for k, v in result["instruments"].items() if k != "memory")
    assert bench.main(["run", "--model", "tiny-llama", "--prompt", "Hi", "--max-new-tokens", "3", "--threads", "1",
                       "--strategies", "full,kvdirect:budget=2"]) == 0
    assert "memory instrument: tensor storages (cpu)" in capsys.readouterr().out
    assert bench.main(["run", "--model", "tiny-llama", "--prompt", "Hi", "--memory", "allocator"]) == 2
    assert "memory: 'allocator' is not allowed; allowed: storage, trace, none" in capsys.readouterr().err
