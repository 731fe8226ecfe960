"""Figures that cannot go stale: every measured figure of the README and docs/ is a marker rendered from a committed
results file, and `bench docs --check` fails naming the page, the file and the figure when the text disagrees."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvdirect_app.cli import doc_figures as docs
from kvdirect_app.cli import main

pytestmark = pytest.mark.check
ROOT = Path(__file__).resolve().parents[2]


def test_every_figure_of_the_pages_is_as_its_results_file_says(capsys):
    assert docs.markers() > 20
    assert main(["docs", "--check"]) == 0, capsys.readouterr().out


def test_a_figure_edited_by_hand_fails_the_check_naming_it(tmp_path, capsys):
    """A copy of the repository's pages and results files; one figure of the README changed by hand: `--check`
    names the page, the file and the figure, and exits 1; `bench docs` writes it back.  Mutation: `check` comparing
    nothing (the edit then passes)."""
    for name in ("README.md", "docs", "presets", "docs/claims"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, dirs_exist_ok=True)
        else:
            shutil.copy(source, tmp_path / name)
    readme = tmp_path / "README.md"
    text = readme.read_text()
    match = next(docs.MARKER.finditer(text), None)
    if match is None:  # the README names no figure itself: edit the first page that does
        readme = next(p for p in docs.pages(tmp_path) if docs.MARKER.search(p.read_text()))
        text = readme.read_text()
        match = docs.MARKER.search(text)
    edited = text[: match.start("text")] + "999.99" + text[match.end("text") :]
    readme.write_text(edited)
    stale = docs.check(tmp_path)
    assert [(s.page, s.file, s.path, s.written) for s in stale] == [
        (str(readme.relative_to(tmp_path)), match["file"], match["path"], "999.99")
    ]
    assert stale[0].measured == match["text"] and "bench docs re-renders it" in stale[0].line()
    assert docs.render(tmp_path) == [str(readme.relative_to(tmp_path))] and not docs.check(tmp_path)


def test_a_marker_whose_file_or_value_is_gone_is_one_line(tmp_path):
    (tmp_path / "README.md").write_text("<!-- fig nowhere.json a.b .2f -->1<!-- /fig -->\n")
    with pytest.raises(docs.FigureError, match="no results file nowhere.json"):
        docs.check(tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"spec": "full", "score": 0.5}]}))
    (tmp_path / "README.md").write_text("<!-- fig r.json rows[spec=h2o].score .2f -->1<!-- /fig -->\n")
    with pytest.raises(
        docs.FigureError, match="README.md: the figure rows\\[spec=h2o\\].score of r.json: 'no item with spec = h2o'"
    ):
        docs.check(tmp_path)
    (tmp_path / "README.md").write_text("<!-- fig r.json rows[spec=full].score .0% -->x<!-- /fig -->\n")
    assert [s.measured for s in docs.check(tmp_path)] == ["50%"]
