"""The Help tab (assets/about.md) and the README's first screen match the page: model-free, no browser."""

import re
from pathlib import Path

import pytest

from kvdirect_app.app.ui.settings import catalogue, title
from kvdirect_app.app.ui.tabs import TABS

pytestmark = pytest.mark.check  # the inner loop (`make check`)

ROOT = Path(__file__).resolve().parents[2]
ABOUT = (ROOT / "assets" / "about.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_help_names_every_tab_of_the_page():
    """Each tab but Help itself is described under its own name.  Fails if a tab is renamed in `TABS` and not in
    about.md, or its bullet is dropped (e.g. `**Time & agreement**` written as `**Latency**`)."""
    missing = [tab for tab in TABS if tab != "Help" and f"**{tab}**" not in ABOUT]
    assert not missing, missing


def test_help_points_only_at_tabs_the_page_has():
    """Every "... tab" in about.md, and every bullet of its tab list, is one of `TABS`, spelled as the page does.
    Fails if about.md sends a visitor to a tab that does not exist ("the papers' numbers are in the Papers tab",
    "the *frontier* tab") or lists one (a "* **Latency**:" bullet)."""
    names = "|".join(re.escape(tab) for tab in TABS)
    mentions = re.findall(r"[^\n]{0,40}?\btab\b", ABOUT)
    assert mentions, "about.md names no tab"
    wrong = [m for m in mentions if not re.search(rf"\b(?:{names})[*\"]*\s+tab$", m)]
    assert not wrong, wrong
    listed = re.findall(r"^\* \*\*([^*\n]+)\*\*:", ABOUT.split("### The tabs", 1)[1].split("###", 1)[0], re.M)
    assert listed and set(listed) <= set(TABS), set(listed) - set(TABS)


def test_help_gives_every_strategy_of_the_catalogue_a_line():
    """One bullet per registered strategy, under the title its pane shows.  Fails if a strategy's line is
    dropped (e.g. KNorm's) or a strategy is registered and about.md not told."""
    lines = ABOUT.splitlines()
    missing = [
        title(name) for name in catalogue() if not any(line.startswith(f"* **{title(name)}**:") for line in lines)
    ]
    assert not missing, missing


def test_readme_opens_with_the_page_and_the_two_commands():
    """The first 40 lines hold the first screen's screenshot, `make demo` and `make test`.  Fails if the screenshot
    or a command is moved below them."""
    head = "\n".join(README.splitlines()[:40])
    assert "](docs/first-screen.png)" in head
    assert "make demo" in head and "make test" in head


def test_every_picture_the_readme_shows_is_committed():
    """Every docs/*.png the README links to exists.  Fails if the README names a screenshot that is not in docs/
    (e.g. a renamed `docs/turn.png`)."""
    pictures = set(re.findall(r"\(\s*(docs/[^)\s]+\.png)\s*\)", README))
    assert "docs/first-screen.png" in pictures
    absent = sorted(p for p in pictures if not (ROOT / p).is_file())
    assert not absent, absent


def test_readme_names_only_tabs_the_page_has():
    """A tab the README names in bold ("the **Claims** tab") is one of `TABS`.  Fails if it names a tab the page no
    longer has (e.g. "the **What am I looking at?** tab")."""
    named = set(re.findall(r"\*\*([^*\n]+)\*\* tab\b", README))
    assert named and named <= set(TABS), named - set(TABS)
