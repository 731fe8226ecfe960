"""A JSON file someone opened (an upload, a results file), read with words that name what they did, never an
exception's class: "the file is empty", "not a text file", "not JSON", "a JSON list, not an object".

What a stranger's file can cost is bounded before it is paid: its size is checked before a byte is read (`read`),
a gzip file is inflated as a stream and refused once it grows past the cap (`inflate`: a 1 MiB file can hold 1 GiB
of zeros), and JSON nested deeper than `MAX_DEPTH` is refused before `json` parses it (a deep enough nesting
exhausts Python's stack: `RecursionError`, in the parser or in whatever walks the value later).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from itertools import accumulate, count
from operator import sub
from pathlib import Path

KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false", type(None): "null"}
MAX_BYTES = 64 << 20  # a file opened here holds at most this much, read as it is or inflated from gzip
MAX_DEPTH = 64  # arrays and objects inside one another (a recording nests 9 deep, a tasks result 7)
CHUNK = 1 << 20  # what one step of `inflate` may add
# A string (its escapes taken out first), or an unterminated one to the end: no byte is scanned twice.
_STRING = re.compile(rb'"[^"]*(?:"|\Z)')
_BRACKETS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # an opening bracket 2, a closing one 0: depth = sum - n
_OTHER = bytes(sorted(set(range(256)) - set(b"[]{}")))


def mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def read(path: str | Path, name: str, expected: str, cap: int = MAX_BYTES) -> bytes:
    """The bytes of the file at `path`, its size checked before any is read (and the read itself bounded, should
    the file grow meanwhile); ValueError with one line naming `name` and the limit."""
    size = os.stat(path).st_size
    too_big = f"{name}: the file is larger than {mib(cap)}, the most the studio opens; expected {expected}"
    if size > cap:
        raise ValueError(too_big)
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(too_big)
    return data


def inflate(data: bytes, name: str, expected: str, cap: int = MAX_BYTES) -> bytes:
    """A gzip file's contents, inflated a chunk at a time and refused (one line) once they pass `cap`: a small
    file that unpacks to gigabytes costs at most `cap` of memory.  Concatenated gzip members are read as gzip does."""
    parts, size, rest = [], 0, data
    try:
        while rest:
            stream = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer
            while not stream.eof:
                part = stream.decompress(rest, CHUNK)
                rest = stream.unconsumed_tail
                size += len(part)
                if size > cap:
                    raise ValueError(
                        f"{name}: unzipped, the file holds more than {mib(cap)}, the most the studio "
                        f"opens; expected {expected}"
                    )
                parts.append(part)
                if not part and not rest:
                    raise ValueError(f"{name}: a damaged gzip file (it ends before its data does); expected {expected}")
            rest = stream.unused_data.lstrip(b"\x00")  # gzip's own padding between members
    except zlib.error:
        raise ValueError(f"{name}: a damaged gzip file (it cannot be unzipped); expected {expected}") from None
    return b"".join(parts)


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the arrays and objects in JSON text `data` nest deeper than `limit` (brackets inside strings do not
    count): passes over the bytes at C speed, no parse, stopping at the first bracket too deep."""
    text = _STRING.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))
    return any(map(limit.__lt__, map(sub, accumulate(text.translate(_BRACKETS, _OTHER)), count(1))))


def parse(data: bytes, name: str, expected: str) -> object:
    """The JSON value in `data`; ValueError with one line naming `name`, what is wrong and what was `expected`
    ("a recording (bench run --record FILE)")."""
    if not data.strip():
        raise ValueError(f"{name}: the file is empty; expected {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not a text file (it holds binary data); expected {expected}") from None
    deep = (
        f"{name}: lists and objects nested more than {MAX_DEPTH} deep, the most the studio opens; expected {expected}"
    )
    if too_deep(data):
        raise ValueError(deep)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{name}: not JSON (line {e.lineno}, column {e.colno}: {e.msg.lower()}); expected {expected}"
        ) from None
    except RecursionError:
        raise ValueError(deep) from None


def not_an_object(value, name: str, expected: str) -> str | None:
    """Why `value` (parsed JSON) is not the object a results file or a recording is: None where it is one."""
    if isinstance(value, dict):
        return None
    return f"{name}: the file holds {KINDS.get(type(value), 'a JSON value')}, not an object; expected {expected}"
