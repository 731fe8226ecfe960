"""The results files' schema: every JSON that `bench run/sweep/reproduce/...` writes, and the `compare`
endpoint returns, starts with

    "schema": "kvdirect-studio/<kind>",   "schema_version": <int>

and is described by `docs/schema/<kind>.json` (JSON Schema, draft 2020-12).  Within a version, fields keep
their names, types and units; new optional fields may appear.  A reader (`check`) refuses a file of another
kind or version with one line naming it.  With KVDIRECT_VALIDATE_JSON=1 (the test suite sets it, so every
file the suite writes, in its own process or in a subprocess, is checked), `stamp` validates the document
against its schema before it is written, and a mismatch is an error.
"""

from __future__ import annotations

import functools
import json
import os

from .errors import UserError
from .paths import data

PREFIX = "kvdirect-studio/"
# kind -> the version this build writes and reads
VERSIONS = {
    "run": 2,  # bench run --json, the compare endpoint (2: the allocator's figures, meter_audit, engine_ms)
    "run-alone": 1,  # bench run --alone --json: each strategy in a process of its own
    "sweep": 1,  # bench sweep --json
    "reproduce": 4,  # bench reproduce: results.json (3: patching, claims 2b, 7b, measured_on; 4: claim 9, tasks)
    "breakeven": 1,  # bench breakeven --json
    "replay": 1,  # bench replay --json
    "capacity": 1,  # bench capacity --json
    # bench tasks --json, presets/tasks/*.json (the Tasks tab) (2: question, context_tokens, scores from the context)
    "tasks": 2,
    "roofline": 2,  # bench roofline --json (2: kernels, ratios, each run's parts_ms)
}


class SchemaError(UserError):
    """A results file of another kind or version than this build reads, or one that does not match its schema."""


def stamp(kind: str, document: dict) -> dict:
    """`document` with its schema id and version first (validated when KVDIRECT_VALIDATE_JSON is set)."""
    out = {
        "schema": PREFIX + kind,
        "schema_version": VERSIONS[kind],
        **{k: v for k, v in document.items() if k not in ("schema", "schema_version")},
    }
    if os.environ.get("KVDIRECT_VALIDATE_JSON"):
        validate(out)
    return out


def check(document, kind: str, name: str = "results") -> dict:
    """`document` if it is a `kind` file of the version this build reads; else SchemaError naming what it is."""
    if not isinstance(document, dict):
        raise SchemaError(f"{name}: not a JSON object; expected a {PREFIX}{kind} results file")
    found, version = document.get("schema"), document.get("schema_version")
    if found != PREFIX + kind:
        what = f"schema {found!r}" if found is not None else "no schema field (written before schema ids)"
        raise SchemaError(f"{name}: {what}; expected {PREFIX + kind!r} version {VERSIONS[kind]}")
    if version != VERSIONS[kind]:
        raise SchemaError(
            f"{name}: {PREFIX}{kind} schema version {version!r} is not supported; this build reads "
            f"version {VERSIONS[kind]}"
        )
    return document


@functools.cache
def schema_of(kind: str) -> dict:
    return json.loads((data("docs/schema") / f"{kind}.json").read_text(encoding="utf-8"))


def validate(document: dict) -> None:
    """Check `document` against its kind's JSON Schema (needs `jsonschema`, a dev dependency); SchemaError names
    the first field that does not match."""
    try:
        import jsonschema  # lazy: an optional dependency (the [dev] extra); only validation needs it
    except ImportError:
        raise SchemaError(
            "KVDIRECT_VALIDATE_JSON is set, but validating needs jsonschema: pip install "
            "'kvdirect-studio[dev]' (or unset KVDIRECT_VALIDATE_JSON)"
        ) from None

    kind = str(document.get("schema", "")).removeprefix(PREFIX)
    if kind not in VERSIONS:
        raise SchemaError(
            f"results: schema {document.get('schema')!r} is not one of {', '.join(PREFIX + k for k in VERSIONS)}"
        )
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema_of(kind)).iter_errors(document))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise SchemaError(f"{PREFIX}{kind} v{VERSIONS[kind]}: {where}: {error.message[:300]}")
