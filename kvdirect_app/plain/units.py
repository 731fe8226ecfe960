"""How numbers are written, the same in the CLI tables and on the page."""

from __future__ import annotations


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt(x, spec=".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def table(cols: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Aligned plain-text table: the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(
        c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])
