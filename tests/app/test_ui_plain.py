"""The UI never imports torch: it reaches the engine only through `kvdirect_app/app/service.py` (plain data).

Two checks that can fail: every UI module's imports, read from its source, are plain modules (a new
`import torch`, or an import of an engine module, fails the first); and in an interpreter where importing torch
raises, the whole UI imports and draws a session from a real run's events, saved to a file (the second).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

from kvdirect_app.engine.runner import Engine
from kvdirect_app.strategies import parse_specs

from ..conftest import tiny

ROOT = Path(__file__).resolve().parents[2]
UI = ROOT / "kvdirect_app" / "app" / "ui"
# Package modules the UI may import besides the plain layer's (kvdirect_app.plain.*): none of them imports torch at
# module level.
PLAIN = {"app.service", "claims", "claims.papers", "claims.verdicts", "claims.render", "claims.reproduce"}
THIRD_PARTY = {"gradio", "plotly", "pandas", "spaces"}


def _imports(path: Path) -> list[str]:
    """Absolute names of what a UI module imports (relative imports resolved against kvdirect_app.app.ui)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = {0: "", 1: "kvdirect_app.app.ui", 2: "kvdirect_app.app", 3: "kvdirect_app"}[node.level]
            module = ".".join(p for p in (base, node.module or "") if p)
            out += [module] if node.module or node.level == 0 else [f"{module}.{a.name}" for a in node.names]
    return out


def test_every_ui_module_imports_only_plain_modules():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in sorted(UI.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("kvdirect_app.app.ui") or top in stdlib or top in THIRD_PARTY or top == "__future__":
                continue
            if name.startswith("kvdirect_app.plain") or name.removeprefix("kvdirect_app.") in PLAIN:
                continue
            if name == "kvdirect_app":
                continue
            bad.append(f"{path.name}: {name}")
    assert not bad, bad


BLOCKED = """
import importlib.abc, json, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, NoTorch())
from kvdirect_app.app.ui import build_demo
from kvdirect_app.app.ui.plots import all_figures
from kvdirect_app.app.ui.scoreboard import scoreboard_html
from kvdirect_app.app.ui.session import Session
from kvdirect_app.app.ui.views import messages, pane_header
session = Session()
for event in json.load(open(sys.argv[1])):
    session.apply(event)
figures = all_figures(session)
board = scoreboard_html(session)
panes = {label: (pane_header(session, label), messages(session, label)) for label in session.shown}
print(json.dumps({"torch": "torch" in sys.modules, "traces": {k: len(f.data) for k, f in figures.items()},
                  "board": board, "panes": list(panes), "replies": [m[-1]["content"] for _, m in panes.values()]}))
"""


def test_the_ui_draws_a_saved_run_where_torch_cannot_be_imported(tmp_path):
    engine = Engine(
        tiny("tiny-llama"), parse_specs("full,kvdirect:budget=4,window:budget=4"), max_new_tokens=5, threads=1
    )
    events = list(engine.run(["Tell me about caches.", "And then?"]))
    saved = tmp_path / "events.json"
    saved.write_text(json.dumps(events))
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(saved)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    drawn = json.loads(out.stdout.strip().splitlines()[-1])
    assert drawn["torch"] is False
    assert drawn["panes"] == ["full", "kvdirect:budget=4", "window:budget=4"]
    assert all(n > 0 for n in drawn["traces"].values()), drawn["traces"]
    assert "window" in drawn["board"] and "exact" in drawn["board"]
    assert all(reply for reply in drawn["replies"])
