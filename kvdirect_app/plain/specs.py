"""A strategy spec's parts, as plain text (no torch: the page reads them too).

    window:budget=64                                   a registered strategy and its settings
    examples/random_eviction.py:RandomEviction:seed=1   a class in a file of one's own, and its settings
    mypackage.strategies:ValueNorm:budget=32            a class in an importable module, and its settings

A spec whose first part ends in ``.py`` or holds a ``/`` names a file; one whose first part is a dotted name
followed by a class name (a capitalised part without ``=``) names a module.  Everything after the class is
``key=value`` settings, as for a registered strategy.

A file or a module is code, so where it may come from is a rule of the process (`serve`, `refusal`): the CLI,
the library and `bench` load any ``.py`` file or module they are given; the web app (`studio`) serves, and then
loads files only from the one folder its operator named (`STRATEGY_DIR`, honoured on a loopback-bound server
only), and modules never.  Nothing that arrives over the web is code or a path otherwise.
"""

from __future__ import annotations

from pathlib import Path

from .hosted import hosted

STRATEGY_DIR = "KVDIRECT_STRATEGY_DIR"  # the operator's switch: the folder the page's extra specs may name files in
_SERVING: list[Path | None] = []  # [the allowed folder, or None for none] once this process serves a page


def external(spec: str) -> tuple[str, str] | None:
    """(file or module, class name) of a spec naming a strategy outside the registry, else None."""
    parts = spec.strip().split(":")
    head = parts[0]
    if head.endswith(".py") or "/" in head:
        return head, parts[1] if len(parts) > 1 else ""
    if "." in head and len(parts) > 1 and parts[1][:1].isupper() and "=" not in parts[1]:
        return head, parts[1]
    return None


def settings_of(spec: str) -> list[str]:
    """The spec's `key=value` parts."""
    parts = spec.strip().split(":")
    return parts[2:] if external(spec) else parts[1:]


def name_of(spec: str) -> str:
    """What a spec's strategy is called on a page: its registered name, or its class's name."""
    found = external(spec)
    return found[1] if found else spec.strip().split(":", 1)[0]


def is_file(source: str) -> bool:
    """Whether a spec's first part names a file (else a module)."""
    return source.endswith(".py") or "/" in source


def serve(folder: str | Path | None) -> None:
    """From now on this process serves the web app: strategy files load only from `folder` (after resolving
    links), modules never, and nothing at all where `folder` is None.  The studio calls it once at start; the CLI
    and the library never do."""
    _SERVING[:] = [Path(folder).resolve() if folder else None]


def page_folder() -> Path | None:
    """The folder the page's extra specs box may name strategy files in (the operator's switch), else None."""
    return _SERVING[0] if _SERVING and not hosted() else None


def refusal(source: str) -> str | None:
    """Why the file or module a spec names must not load in this process, in one line; None where it may."""
    if is_file(source) and not source.endswith(".py"):
        return f"{source}: a strategy file must be a Python file; allowed: PATH.py:ClassName"
    if not _SERVING:
        return None
    folder = page_folder()
    if folder is None:
        return (
            f"{source}: strategy files and modules do not run in this web app (code is never taken from a web "
            f"request); allowed: the registered strategies, or on a server bound to loopback, .py files from "
            f"the folder its operator names with {STRATEGY_DIR}=FOLDER"
        )
    if not is_file(source):
        return (
            f"{source}: modules are not imported by this web app; allowed: the registered strategies, or "
            f"PATH.py:ClassName for a file in {folder} ({STRATEGY_DIR})"
        )
    real = Path(source).resolve()
    if not real.is_relative_to(folder) or real.suffix != ".py":
        return (
            f"{source}: outside the strategy folder once links are resolved; allowed: a .py file in {folder} "
            f"({STRATEGY_DIR})"
        )
    return None
