"""`bench check-strategy` and a strategy from one's own file in every command: the example passes the kit on every
model, each built-in passes it, and a strategy that breaks a rule fails that rule in one line (exit 1).  File and
module specs run in `bench run`, `tasks` and `sweep` with the figures a built-in gets (on Ray:
tests/benchmarks/test_executors.py); hosted mode refuses them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvdirect_app.benchmarks import api as benchmarks
from kvdirect_app.benchmarks import conformance
from kvdirect_app.cli import main
from kvdirect_app.strategies import Strategy, StrategyError, parse_spec

from ..specs import every

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/random_eviction.py:RandomEviction"
TINY = ("tiny-llama", "tiny-gemma3")

BROKEN = """
from dataclasses import dataclass
import threading
import torch
from kvdirect_app.strategies.scored import Scored, ScoredLayer
from kvdirect_app.strategies.window import Window


@dataclass
class Short(Window):
    def score(self, step):
        return step.positions.float()[..., 1:]


@dataclass
class NotANumber(Window):
    def score(self, step):
        out = step.positions.float()
        out[..., 0] = float("nan")
        return out


class _Greedy(ScoredLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.keys.shape[-2] >= 2:
            self.keys = torch.cat([self.keys[..., :1, :], self.keys], dim=-2)
            self.values = torch.cat([self.values[..., :1, :], self.values], dim=-2)
            self.positions = torch.cat([self.positions[..., :1], self.positions], dim=-1)
        return out


@dataclass
class OverBudget(Window):
    def global_layer(self, projector=None, rank=0, count=1):
        return _Greedy(self, None, rank, count)


@dataclass
class HiddenNumpy(Window):
    def score(self, step):
        self.kept = getattr(self, "kept", []) + [step.keys.numpy().copy()]
        return super().score(step)


@dataclass
class HiddenClone(Window):
    def score(self, step):
        self.copy = step.keys.clone()
        return super().score(step)


class NotAStrategy:
    pass
"""


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mine") / "broken.py"
    path.write_text(BROKEN)
    return path


def _failed(findings) -> dict[str, list[str]]:
    out = {}
    for f in findings:
        if not f.ok:
            out.setdefault(f.rule, []).append(f.line())
    return out


def test_the_example_passes_every_rule_on_every_model():
    """The example from examples/ on the tiny families and SmolLM2, as a researcher runs it (under 2 minutes)."""
    findings = conformance.check(EXAMPLE)
    assert not _failed(findings), _failed(findings)
    assert {f.model for f in findings} == set(conformance.MODELS)
    assert {f.rule for f in findings} == {
        "contract",
        "scores",
        "read-only step",
        "budget",
        "determinism",
        "bytes",
        "nothing hidden",
        "sliding layers",
        "against the full cache",
        "time",
    }


@pytest.mark.check
@pytest.mark.parametrize("spec", every(("anchorkv:spacing=2", "anchorkv:rebuild=step")))  # the rest at defaults
def test_every_built_in_passes(spec):
    findings = conformance.check(spec, TINY)
    assert not _failed(findings), _failed(findings)


@pytest.mark.check
@pytest.mark.parametrize(
    "cls, rule, words",
    [
        ("Short", "contract", "score() returned (1, 1,"),
        ("NotANumber", "contract", "score() returned NaN"),
        ("OverBudget", "contract", "more than the"),
        ("HiddenNumpy", "nothing hidden", "outside torch"),
        ("HiddenClone", "bytes", "measured differs from its formula"),
    ],
)
def test_a_strategy_that_breaks_a_rule_fails_that_rule_in_one_line(broken, cls, rule, words, capsys):
    """Each failure is one line naming the rule, the model and the step; the command exits 1.  Mutations: the
    engine's contract checks removed (Short, NotANumber, OverBudget pass), the outside-torch rule removed
    (HiddenNumpy passes), the formula rule removed (HiddenClone passes)."""
    assert main(["check-strategy", f"{broken}:{cls}", "--models", "tiny-llama"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert lines and all(line.startswith(f"FAIL {rule} on tiny-llama: ") for line in lines), lines
    assert any(words in line for line in lines), lines


@pytest.mark.check
@pytest.mark.parametrize(
    "spec, words",
    [
        ("{broken}:NotAStrategy", "NotAStrategy is not a strategy"),
        ("{broken}:Missing", "no class Missing"),
        ("nowhere/none.py:Mine", "no such file"),
        ("no_such_package.strategies:Mine", "the module cannot be imported"),
        ("{broken}:Short:budget=0", "budget=0 must be >= 1"),
        ("{broken}:Short:colour=red", "unknown setting 'colour'"),
    ],
)
def test_a_bad_file_or_module_spec_is_one_line(broken, spec, words, capsys):
    assert (
        main(["run", "--model", "tiny-llama", "--prompt", "Hi", "--strategies", "full," + spec.format(broken=broken)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.check
def test_a_file_spec_runs_with_the_figures_a_built_in_gets(tmp_path):
    """The example's class in a file outside the package, in `bench run`: a strategy whose every choice equals the
    window's (score = position) gets the window's tokens, bytes and formula check; its label is its spec."""
    mine = tmp_path / "mine.py"
    mine.write_text(
        "from dataclasses import dataclass\nfrom kvdirect_app.strategies.scored import Scored\n\n\n"
        "@dataclass\nclass Newest(Scored):\n    def score(self, step):\n"
        "        return step.positions.float()\n"
    )
    out = tmp_path / "run.json"
    spec = f"{mine}:Newest:budget=6"
    assert (
        main(
            [
                "run",
                "--model",
                "tiny-llama",
                "--prompt",
                "Tell me about the sea and the sky.",
                "--threads",
                "1",
                "--max-new-tokens",
                "5",
                "--strategies",
                f"full,window:budget=6,{spec}",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())["strategies"]
    theirs, window = result[spec], result["window:budget=6"]
    assert theirs["token_ids"] == window["token_ids"] and theirs["canonical_spec"] == f"{mine}:Newest:budget=6"
    for key in ("between_turns_peak", "persistent_peak", "peak", "formula_matches_measurement"):
        assert theirs["state_bytes"][key] == window["state_bytes"][key], key


@pytest.mark.check
def test_a_module_spec_runs_in_tasks_and_sweep(tmp_path, monkeypatch):
    """A package of one's own on the path: `tasks` (on the local pool: the spec crosses to a worker process) and
    `sweep` run its class by `module:Class`."""
    package = tmp_path / "mystrategies"
    package.mkdir()
    shutil.copy(ROOT / "examples" / "random_eviction.py", package / "random_eviction.py")
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    spec = "mystrategies.random_eviction:RandomEviction"
    out = benchmarks.tasks(
        benchmarks.TasksConfig(
            model="tiny-llama",
            contexts="512",
            depths="50",
            tasks="niah_single_number",
            budgets="8",
            strategies=spec,
            threads=1,
            executor="local",
        ),
        say=lambda line: None,
    )
    assert f"{spec}:budget=8" in out["cells"][0]["lanes"]
    sweep = benchmarks.sweep(
        benchmarks.SweepConfig(
            model="tiny-llama",
            prompt="Tell me about caches.",
            strategies=spec,
            budgets="4,8",
            max_new_tokens=3,
            threads=1,
        ),
        say=lambda line: None,
    )
    assert [r["spec"] for r in sweep["rows"]] == [f"{spec}:budget=4", f"{spec}:budget=8"]


@pytest.mark.check
def test_hosted_mode_refuses_file_and_module_specs(monkeypatch):
    monkeypatch.setenv("KVDIRECT_HOSTED", "1")
    for spec in (EXAMPLE, "mystrategies.random_eviction:RandomEviction"):
        with pytest.raises(StrategyError, match="do not run on this hosted demo"):
            parse_spec(spec)


@pytest.mark.check
def test_a_subclass_never_takes_a_registered_strategys_name():
    """A class that keeps a built-in's name (or names itself so) is not registered in its place: `window` stays
    the window.  Mutation: registration as it was (every subclass with a `name` took it)."""
    from kvdirect_app.strategies.window import Window

    before = Strategy.registry["window"]

    class Mine(Window):
        name = "window"

    class Quiet(Window):
        pass

    assert Strategy.registry["window"] is before and type(parse_spec("window")) is before
    assert "Quiet" not in Strategy.registry
