"""What the claim builders share: a section's cells, a run's mode, the words numbers are written in, and
where a section's cells ran."""

from __future__ import annotations

from ..papers import CLAIMS
from ..render import figure_text, number

UNRECORDED = "mode not recorded"  # a run JSON written before the engine recorded `mode`


def section_cells(results: dict, section: str) -> list[dict]:
    """The cells of one section of the report (`papers.section_of` names a claim's)."""
    return [c for c in results["cells"] if c["section"] == section]


def run_mode(r: dict):
    """A lane's `mode`: "exact" | "fast" for the rebuilding strategies, None for the others."""
    return r.get("mode", UNRECORDED)


def times(value) -> str:
    """A ratio in words: '2.45x'."""
    return f"{number(value)}x"


def paper_figure(name: str, key: str) -> str:
    """The paper's figure `key` of claim `name`, with its unit."""
    f = next(f for f in CLAIMS[name].figures if f.key == key)
    return figure_text(f.value, f.unit)


def listed(items) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = [str(i) for i in items]
    return " and ".join(items) if len(items) < 3 else f"{', '.join(items[:-1])} and {items[-1]}"


def plural(n: int, noun: str) -> str:
    """'1 layer', '3 layers'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


# --- where a section's cells ran: a verdict's scope ---------------------------------------------------------------
def _kernels(cell: dict) -> str:
    """The kernels a cell's numbers came from, as its JSON records them."""
    k = cell["json"].get("kernels")
    if isinstance(k, dict):
        return k.get("mode", UNRECORDED)
    if isinstance(k, str):
        return k
    return "none (arithmetic)" if not (cell.get("env") or {}).get("threads") else "not recorded"


def measured_on(results: dict, section: str, cells: list[dict] | None = None) -> str:
    """Devices and kernels of a section's cells (or of `cells`), in words: what a verdict's scope is."""
    cells = section_cells(results, section) if cells is None else cells
    devices = sorted({str((c.get("env") or {}).get("device", "not recorded")) for c in cells})
    kernels = sorted({_kernels(c) for c in cells})
    return f"devices: {', '.join(devices) or 'none'}; kernels: {', '.join(kernels) or 'none'}"


def environments(results: dict, section: str) -> list[dict]:
    """The distinct environments the section's cells ran in (recorded in the worker that ran each)."""
    seen = []
    for c in section_cells(results, section):
        env = c.get("env")
        if env not in seen:
            seen.append(env)
    return seen
