"""A JSON file someone opened (an upload, a results file), read with words that name what they did, never an
exception's class: "the file is empty", "not a text file", "not JSON", "a JSON list, not an object"."""

from __future__ import annotations

import json

KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
         type(None): "null"}


def parse(data: bytes, name: str, expected: str) -> object:
    """The JSON value in `data`; ValueError with one line naming `name`, what is wrong and what was `expected`
    ("a recording (bench run --record FILE)")."""
    if not data.strip():
        raise ValueError(f"{name}: the file is empty; expected {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not a text file (it holds binary data); expected {expected}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not JSON (line {e.lineno}, column {e.colno}: {e.msg.lower()}); expected "
                         f"{expected}") from None


def not_an_object(value, name: str, expected: str) -> str | None:
    """Why `value` (parsed JSON) is not the object a results file or a recording is: None where it is one."""
    if isinstance(value, dict):
        return None
    return f"{name}: the file holds {KINDS.get(type(value), 'a JSON value')}, not an object; expected {expected}"
