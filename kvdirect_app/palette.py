"""One colour per strategy, the same in every plot, pane and export (Okabe-Ito: readable for colour-blind
viewers and on projectors).  A colour belongs to a strategy's name, so ticking another strategy never
recolours the ones already shown; several settings of one strategy get its colour in lighter or darker
shades."""

from __future__ import annotations

REFERENCE_COLOUR = "#333333"
COLOURS = {
    "full": REFERENCE_COLOUR,
    "kvdirect": "#0072B2",
    "anchorkv": "#009E73",
    "h2o": "#D55E00",
    "streaming_llm": "#CC79A7",
    "snapkv": "#E69F00",
    "tova": "#56B4E9",
    "window": "#8B4513",
}
SPARE = ["#7F3C8D", "#3D9970", "#B8860B", "#1F3A93", "#A0522D"]


def strategy_name(label: str) -> str:
    return label.split(":", 1)[0]


def base_colour(name: str) -> str:
    if name in COLOURS:
        return COLOURS[name]
    return SPARE[sum(map(ord, name)) % len(SPARE)]


def _shade(colour: str, k: int) -> str:
    """The k-th variant of a colour: 0 itself, then alternately darker and lighter."""
    if k == 0:
        return colour
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    factor = 1 - 0.25 * ((k + 1) // 2) if k % 2 else 1 + 0.35 * (k // 2)
    mix = lambda c: max(0, min(255, int(c * factor if factor < 1 else c + (255 - c) * (factor - 1))))
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def colours(labels: list[str]) -> dict[str, str]:
    """label -> colour: the strategy's colour, shaded for its second, third... setting in `labels`."""
    seen: dict[str, int] = {}
    out = {}
    for label in labels:
        name = strategy_name(label)
        k = seen.get(name, 0)
        seen[name] = k + 1
        out[label] = _shade(base_colour(name), k)
    return out
