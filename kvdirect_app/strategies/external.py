"""Strategies from outside the package: a class in a file of one's own or in an importable module.

    bench run --strategies full,examples/random_eviction.py:RandomEviction:budget=64:seed=1
    bench run --strategies full,mypackage.strategies:ValueNorm:budget=32

The class subclasses one of the public bases (`PUBLIC_BASES`: `Scored` for an eviction method, `KVDirect` or
`AnchorKV` to extend an exact family); its settings are its dataclass fields, checked like a registered
strategy's.  A file is imported once per content (its text's hash names the module), so an edited file is read
again; its path and class are the strategy's spec (`Strategy.spec`), so a worker process (the local pool, a Ray
task) finds it the same way.  A Ray task on another machine may not have the file: `carry` puts the files a cell
names in the cell, and `provided` makes them known in the worker before the cell runs.

A file must end in `.py` everywhere.  Hosted mode (a public Space) refuses every file and module spec: a visitor
must not run code there.  The web app (`specs.serve`, set once at its start) loads files only from the folder its
operator allowed, after resolving links, and modules never, whichever route a spec came by (`specs.refusal`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from ..plain.hosted import hosted
from ..plain.specs import external, is_file, refusal
from .anchorkv import AnchorKV
from .base import Strategy, StrategyError
from .kvdirect import KVDirect
from .scored import Scored

CARRIED = "_strategy_files"  # a cell's key: {path: text} of the strategy files it names
_TEXTS: dict[str, str] = {}  # path -> text carried here from the process that planned the cell


def public_bases() -> tuple[type, ...]:
    return Scored, KVDirect, AnchorKV


def load(spec: str) -> type[Strategy]:
    """The class a file or module spec names (StrategyError, one line, where it cannot be had)."""
    source, name = external(spec)
    if hosted():
        raise StrategyError(
            f"{source}:{name}: strategies from files or modules do not run on this hosted demo (a "
            "visitor's code is not run here); allowed: the registered strategies"
        )
    why = refusal(source)
    if why:
        raise StrategyError(why)
    if not name:
        raise StrategyError(f"{source}: no class named; allowed: {source}:ClassName[:key=value...]")
    module = _from_file(source) if is_file(source) else _from_module(source)
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not issubclass(cls, Strategy):
        raise StrategyError(
            f"{source}:{name}: {'no class ' + name if cls is None else name + ' is not a strategy'} "
            f"there; allowed: a class that subclasses Scored, KVDirect or AnchorKV"
        )
    if not issubclass(cls, public_bases()):
        raise StrategyError(
            f"{source}:{name}: {name} subclasses none of the public bases; allowed: a subclass of "
            "Scored (an eviction method), KVDirect or AnchorKV (an exact family)"
        )
    cls._source = f"{source}:{name}"
    return cls


def _from_file(path: str):
    text = _TEXTS.get(path)
    if text is None:
        file = Path(path)
        if not file.is_file():
            raise StrategyError(
                f"{path}: no such file; allowed: the path of a Python file holding the strategy's class"
            )
        text = file.read_text(encoding="utf-8")
    key = "kvdirect_strategy_" + hashlib.sha256(f"{path}\n{text}".encode()).hexdigest()[:16]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_loader(key, loader=None, origin=path)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[key] = module
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)
    except Exception as e:
        del sys.modules[key]
        raise StrategyError(
            f"{path}: importing it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    return module


def _from_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise StrategyError(
            f"{name}: the module cannot be imported ({e}); allowed: an importable module's dotted name"
        ) from None


def carry(cell: dict) -> dict:
    """`cell` with the text of every strategy file its strings name (a Ray task on another machine reads them),
    beside any it carries already."""
    files = dict(cell.get(CARRIED) or {})

    def walk(value):
        if isinstance(value, str):
            for part in value.split(","):
                found = external(part)
                if found and found[0].endswith(".py") and Path(found[0]).is_file():
                    files[found[0]] = Path(found[0]).read_text(encoding="utf-8")
        elif isinstance(value, dict):
            for k, v in value.items():
                if k != CARRIED:  # a file's text is no spec
                    walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(cell)
    return {**cell, CARRIED: files} if files else cell


def provided(cell: dict) -> dict:
    """The files `carry` put in `cell`, known here (a spec naming one loads it from its text); the cell without
    them."""
    files = cell.get(CARRIED) if isinstance(cell, dict) else None
    if not files:
        return cell
    _TEXTS.update(files)
    return {k: v for k, v in cell.items() if k != CARRIED}
