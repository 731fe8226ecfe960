"""A plotly figure to PNG with nothing loaded from the network and no race with the page's own scripts.

kaleido draws through a Chromium page whose scripts are, in order, MathJax from a CDN, plotly.js (4.8 MB) and its
own `kaleido_scopes.js`, and calls `kaleido_scopes.plotly(spec)` once it has seen the page's `load` event.  Two
things made that call fail ("kaleido_scopes is not defined", in CI and about one render in ten on a loaded
machine here):

* Where the network is closed (CI, a booth) the MathJax request decides when the page's own script runs.  Our
  figures use no LaTeX: MathJax is left out, and the page loads local files only.
* kaleido listens for `Page.loadEventFired` before it navigates its new tab; on a loaded machine the blank tab's
  own load event arrives after that, so kaleido takes it for the page's and calls while plotly.js is still being
  parsed (seen in the event order: the load event before the page's execution context, in every failure).  The
  page therefore defines a stand-in `kaleido_scopes` first thing in its head: a call that reaches it waits for the
  page's real `load` and then hands the figure to the real `kaleido_scopes`, which replaced the stand-in when its
  script ran.  A call after `load` goes to the real one directly.
"""

from __future__ import annotations

from pathlib import Path

WAIT_FOR_LOAD = """        <script>
            window.kaleido_scopes = {plotly: (...args) => new Promise(loaded => window.addEventListener("load", loaded))
                .then(() => window.kaleido_scopes.plotly(...args))};
        </script>
"""


def _kaleido():
    """kaleido, imported when a PNG is first drawn."""
    import kaleido  # lazy: a Chromium driver (~0.2 s of import) only drawing a PNG needs

    return kaleido


def page():
    """kaleido's page without MathJax, with the stand-in that waits for the page's `load` first in its head."""
    kaleido = _kaleido()

    class Page(kaleido.PageGenerator):
        header = kaleido.PageGenerator.header.replace("<head>", "<head>\n" + WAIT_FOR_LOAD, 1)

    if WAIT_FOR_LOAD not in Page.header:
        raise RuntimeError("kaleido's page has no <head> to put the wait for its scripts in")
    return Page(mathjax=False)


def write_png(fig, path, width: int, height: int, scale: float = 1) -> Path:
    """`fig` drawn as a PNG of `width` x `height` (times `scale`) into `path`, through `page()`."""
    data = _kaleido().calc_fig_sync(
        fig, opts={"format": "png", "width": width, "height": height, "scale": scale}, kopts={"page_generator": page()}
    )
    path = Path(path)
    path.write_bytes(data)
    return path
