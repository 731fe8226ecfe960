"""A plotly figure to PNG with nothing loaded from the network.

kaleido draws through a Chromium page whose scripts are, in order, MathJax from a CDN, plotly.js and its own
`kaleido_scopes.js`.  Where the network is closed (CI, a booth) that CDN request decides when the page's own script
has run, and a figure sent before it fails ("kaleido_scopes is not defined").  Our figures use no LaTeX: MathJax is
left out, and the page loads local files only.
"""

from __future__ import annotations

from pathlib import Path


def write_png(fig, path, width: int, height: int, scale: float = 1) -> Path:
    import kaleido

    data = kaleido.calc_fig_sync(fig, opts={"format": "png", "width": width, "height": height, "scale": scale},
                                 kopts={"mathjax": False})
    path = Path(path)
    path.write_bytes(data)
    return path
