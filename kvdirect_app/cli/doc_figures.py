"""Figures that cannot go stale: every measured figure in the README and docs/ is rendered from a committed results
file (`bench docs`), and `bench docs --check` says which figure disagrees with its file (exit 1), as CI runs it;
both commands are here (`register`), beside the figures they render and check.

    python -m kvdirect_app.bench docs --check

A figure in a page is a marker around its text:

    <!-- fig presets/tasks/smollm2-135m.json rows[spec=full].score .2f -->0.42<!-- /fig -->

naming the results file (a path from the repository's root; ``.gz`` read as such), where the value lies in it, and
how it is written.  The path is dotted keys and list steps: ``[3]`` an index, ``[-1]`` the last, ``[key=value]``
the first item whose field equals the value (compared as text).  The format is Python's (``.2f``, ``,d``,
``.0%``) or one of `UNITS`: ``bytes`` (KiB/MiB, as the tables), ``min`` (seconds as minutes), ``x`` (a ratio:
``3.5x``), ``s`` (seconds, one decimal), ``date`` (the first ten characters).  `render` writes every marker's text
from its file; `check` lists each one whose text differs, or whose file or value is missing.  Nothing here reads
a number a person typed: a figure with no marker is not a measured figure of the docs (`bench docs --check`
cannot vouch for it, so the pages keep none).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..plain.units import fmt_bytes
from .common import CliError

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!-- fig (?P<file>\S+) (?P<path>\S+) (?P<fmt>\S+) -->(?P<text>.*?)<!-- /fig -->", re.S)
UNITS = {
    "bytes": lambda v: fmt_bytes(v),
    "min": lambda v: f"{v / 60:.0f} min",
    "x": lambda v: f"{v:.2f}x",
    "s": lambda v: f"{v:.1f} s",
    "date": lambda v: str(v)[:10],
}


class FigureError(ValueError):
    """A marker whose file or value cannot be had; the message names the page, the file and the path."""


@dataclass
class Stale:
    page: str
    file: str
    path: str
    written: str
    measured: str

    def line(self) -> str:
        return (
            f"{self.page}: the figure {self.path} of {self.file} reads {self.written!r}; its file says "
            f"{self.measured!r} (bench docs re-renders it)"
        )


_STEP = re.compile(r"([^.\[\]]+)|\[([^\]]+)\]")


def value(document, path: str):
    """The value at `path` (see the module's docstring) in a parsed results file; KeyError naming the step."""
    here = document
    for key, step in _STEP.findall(path):
        if key:
            if not isinstance(here, dict) or key not in here:
                raise KeyError(f"no {key!r} here")
            here = here[key]
        elif "=" in step:
            field, _, want = step.partition("=")
            found = (
                [x for x in here if isinstance(x, dict) and str(x.get(field)) == want] if isinstance(here, list) else []
            )
            if not found:
                raise KeyError(f"no item with {field} = {want}")
            here = found[0]
        else:
            if not isinstance(here, list) or not -len(here) <= int(step) < len(here):
                raise KeyError(f"no item [{step}]")
            here = here[int(step)]
    return here


def written(v, fmt: str) -> str:
    """`v` as the page writes it."""
    if fmt in UNITS:
        return UNITS[fmt](v)
    return format(v, fmt)


class Files:
    """Results files, each parsed once."""

    def __init__(self, root: Path = ROOT):
        self.root, self.parsed = root, {}

    def __call__(self, name: str):
        if name not in self.parsed:
            path = self.root / name
            if not path.is_file():
                raise FigureError(f"no results file {name}")
            data = path.read_bytes()
            self.parsed[name] = json.loads(gzip.decompress(data) if name.endswith(".gz") else data)
        return self.parsed[name]


def figure(match: re.Match, files: Files, page: str) -> str:
    try:
        return written(value(files(match["file"]), match["path"]), match["fmt"])
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise FigureError(f"{page}: the figure {match['path']} of {match['file']}: {e}") from None


def pages(root: Path = ROOT) -> list[Path]:
    out = []
    for pattern in PAGES:
        out += sorted(root.glob(pattern))
    return out


def check(root: Path = ROOT) -> list[Stale]:
    """Every marker whose text is not what its file gives (FigureError where a file or value is missing)."""
    files, out = Files(root), []
    for page in pages(root):
        name = str(page.relative_to(root))
        for m in MARKER.finditer(page.read_text(encoding="utf-8")):
            now = figure(m, files, name)
            if m["text"] != now:
                out.append(Stale(name, m["file"], m["path"], m["text"], now))
    return out


def render(root: Path = ROOT) -> list[str]:
    """Every marker's text written from its file; the pages changed."""
    files, changed = Files(root), []
    for page in pages(root):
        name = str(page.relative_to(root))
        text = page.read_text(encoding="utf-8")
        new = MARKER.sub(lambda m: m.group(0).replace(f"-->{m['text']}<!--", f"-->{figure(m, files, name)}<!--"), text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(name)
    return changed


def markers(root: Path = ROOT) -> int:
    return sum(len(MARKER.findall(p.read_text(encoding="utf-8"))) for p in pages(root))


# --- the command ---------------------------------------------------------------------------------------------------
def cmd_docs(args) -> int:
    try:
        if args.check:
            stale = check()
            for s in stale:
                print(s.line())
            print(
                f"{markers()} figures in {len(pages())} pages; "
                + (f"{len(stale)} disagree with their results files" if stale else "every one as its file says")
            )
            return 1 if stale else 0
        changed = render()
    except FigureError as e:
        raise CliError(str(e)) from None
    print(f"re-rendered {len(changed)} page(s): {', '.join(changed) or 'none changed'}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "docs", help="the README's and docs/'s figures from their results files (--check: say which disagree)"
    )
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each figure that disagrees")
    p.set_defaults(func=cmd_docs)
    return p
