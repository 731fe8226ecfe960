"""A strategy spec's parts, as plain text (no torch: the page reads them too).

    window:budget=64                                   a registered strategy and its settings
    examples/random_eviction.py:RandomEviction:seed=1   a class in a file of one's own, and its settings
    mypackage.strategies:ValueNorm:budget=32            a class in an importable module, and its settings

A spec whose first part ends in ``.py`` or holds a ``/`` names a file; one whose first part is a dotted name
followed by a class name (a capitalised part without ``=``) names a module.  Everything after the class is
``key=value`` settings, as for a registered strategy.
"""

from __future__ import annotations


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
