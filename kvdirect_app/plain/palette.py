"""One colour and one marker symbol per strategy, the same in every plot, pane and export (Okabe-Ito:
readable for colour-blind viewers and on projectors).  Both belong to a strategy's name, so ticking another
strategy never recolours the ones already shown; several settings of one strategy shown together get shades
of its colour, each picked from its own spec (not from where it sits in the list)."""

from __future__ import annotations

import zlib

from .specs import name_of

REFERENCE_COLOUR = "#333333"
COLOURS = {
    "full": REFERENCE_COLOUR,
    "kvdirect": "#0072B2",
    "anchorkv": "#009E73",
    "h2o": "#D55E00",
    "streaming_llm": "#CC79A7",
    "snapkv": "#E69F00",
    "tova": "#56B4E9",
    "knorm": "#882255",
    "pyramidkv": "#999933",
    "window": "#8B4513",
}
SPARE = ["#7F3C8D", "#3D9970", "#B8860B", "#1F3A93", "#A0522D"]
# Open shapes: where two strategies hold the same bytes their lines coincide, and both markers stay visible.
SYMBOLS = {
    "full": "circle-open",
    "kvdirect": "square-open",
    "anchorkv": "diamond-open",
    "h2o": "triangle-up-open",
    "streaming_llm": "triangle-down-open",
    "snapkv": "star-open",
    "tova": "x-open",
    "knorm": "cross-open",
    "pyramidkv": "pentagon-open",
    "window": "hexagon-open",
}
SPARE_SYMBOLS = ["pentagon-open", "cross-open", "hourglass-open", "bowtie-open", "star-square-open"]
# Shades for several settings of one strategy: < 0 towards black, > 0 towards white (0: the colour itself).
SHADES = (0.0, -0.3, 0.3, -0.5, 0.45, -0.15, 0.15, -0.65)


def strategy_name(label: str) -> str:
    """A spec's strategy: its registered name, or the class of a file's or module's (`specs.name_of`)."""
    return name_of(label)


def _spare(name: str, options: list[str]) -> str:
    return options[sum(map(ord, name)) % len(options)]


def base_colour(name: str) -> str:
    return COLOURS[name] if name in COLOURS else _spare(name, SPARE)


def symbol(label: str) -> str:
    name = strategy_name(label)
    return SYMBOLS[name] if name in SYMBOLS else _spare(name, SPARE_SYMBOLS)


def shade(colour: str, amount: float) -> str:
    if not amount:
        return colour
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    mix = (lambda c: c * (1 + amount)) if amount < 0 else (lambda c: c + (255 - c) * amount)
    return "#" + "".join(f"{round(mix(c)):02x}" for c in (r, g, b))


def colours(labels: list[str]) -> dict[str, str]:
    """label -> colour: the strategy's colour; where several of its settings are shown, each a shade picked by
    a hash of its spec (a clash goes to the next free shade, in the specs' sorted order), never by its place
    in the list or by the other strategies shown."""
    groups: dict[str, list[str]] = {}
    for label in dict.fromkeys(labels):
        groups.setdefault(strategy_name(label), []).append(label)
    out = {}
    for name, group in groups.items():
        taken: set[int] = set()
        for label in sorted(group):
            k = 0 if len(group) == 1 else zlib.crc32(label.encode()) % len(SHADES)
            while k in taken and len(taken) < len(SHADES):
                k = (k + 1) % len(SHADES)
            taken.add(k)
            out[label] = shade(base_colour(name), SHADES[k])
    return {label: out[label] for label in labels}
