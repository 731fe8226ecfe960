"""The results files' schema (kvdirect_app/plain/schema.py, docs/schema/*.json).

Every file the suite writes is validated before it is written (conftest sets KVDIRECT_VALIDATE_JSON); these
tests check that the validation can fail, that the schemas are valid JSON Schema, that the committed claims
results match theirs, and that readers refuse another version naming it.
"""

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from kvdirect_app import bench
from kvdirect_app.claims import reproduce
from kvdirect_app.plain import recording
from kvdirect_app.plain.schema import VERSIONS, SchemaError, check, schema_of, stamp, validate

ROOT = Path(__file__).resolve().parents[2]


def test_every_schema_is_valid_json_schema_and_every_kind_has_one():
    assert sorted(p.stem for p in (ROOT / "docs" / "schema").glob("*.json")) == sorted(VERSIONS)
    for kind in VERSIONS:
        jsonschema.Draft202012Validator.check_schema(schema_of(kind))


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("schema") / "run.json"
    assert (
        bench.main(
            [
                "run",
                "--model",
                "tiny-llama",
                "--strategies",
                "full,kvdirect:budget=4,h2o:budget=4",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "4",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def test_a_written_run_names_its_schema_and_matches_it(run_json):
    assert run_json["schema"] == "kvdirect-studio/run" and run_json["schema_version"] == VERSIONS["run"]
    assert list(run_json)[:2] == ["schema", "schema_version"]
    validate(run_json)
    check(run_json, "run")


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda d: d["strategies"]["full"].update(token_match="all"), "strategies/full/token_match"),
        (
            lambda d: d["strategies"]["kvdirect:budget=4"]["state_bytes"].pop("peak"),
            "strategies/kvdirect:budget=4/state_bytes",
        ),
        (lambda d: d.update(threads=0), "threads"),
        (lambda d: d.update(schema_version=VERSIONS["run"] + 1), "schema_version"),
    ],
)
def test_validation_fails_on_a_changed_field_naming_it(run_json, change, where):
    bad = copy.deepcopy(run_json)
    change(bad)
    with pytest.raises(SchemaError) as info:
        validate(bad)
    assert where in str(info.value) and "\n" not in str(info.value)


def test_readers_refuse_another_version_naming_it(run_json, tmp_path):
    with pytest.raises(
        SchemaError, match=f"schema version 7 is not supported; this build reads version {VERSIONS['run']}"
    ):
        check({**run_json, "schema_version": 7}, "run")
    with pytest.raises(SchemaError, match="no schema field"):
        check({k: v for k, v in run_json.items() if k != "schema"}, "run")
    committed = json.loads((ROOT / "docs" / "claims" / "results.json").read_text())
    validate(committed)
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({**committed, "schema_version": 1}))
    with pytest.raises(reproduce.ResultsError, match="reproduce schema version 1 is not supported"):
        reproduce.load(folder)
    # The app's importer (the recording upload) names what a results file is and how to make a recording of it.
    with pytest.raises(recording.RecordingError, match=f"kvdirect-studio/run version {VERSIONS['run']}.*--record"):
        recording.parse(json.dumps(run_json).encode(), "run.json")


def test_stamp_puts_the_id_first_and_checks_when_asked(monkeypatch):
    monkeypatch.setenv("KVDIRECT_VALIDATE_JSON", "1")
    with pytest.raises(SchemaError, match="breakeven"):
        stamp("breakeven", {"layers": 2})
    monkeypatch.delenv("KVDIRECT_VALIDATE_JSON")
    assert list(stamp("breakeven", {"layers": 2, "schema": "old"})) == ["schema", "schema_version", "layers"]
