"""The conformance kit's rules, one broken strategy each (tests/broken_strategies.py): each fails its rule in one line
naming the rule and the step, through the command a researcher runs (a subprocess: exit 1, no traceback, the
findings so far kept); the kit still passes the example and every built-in (tests/benchmarks/test_check_strategy.py).

Mutations tried (each made the named test fail, then was undone): the against-the-full-cache rule reading the
class's `exact` again (Inflated passed); the budget read from the strategy's own `stored` instead of its family's
(NeverEvicts and FourTimes passed), the bytes against its family's skipped (Hoards passed); the determinism rule
removed (Unseeded passed); the step's digest taken after
the call (EditsKeys passed); the dtype check removed (HalfScores: no float16 line), the +inf count removed
(Overflows passed); the per-call time limit removed (Slow ran 30 s, to the run's limit); the alarm removed (Hangs
stopped only after its minute, in no score() call); the score wrapper's `except Exception` removed (RaisesLater's
line no longer named the layer), the run's (BadFormula ended in a traceback); the device check removed (MetaScores
failed as a contract error, not as scores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdirect_app.benchmarks import conformance

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests/broken_strategies.py"


def _kit(cls: str, models: str = "tiny-llama") -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "kvdirect_app.bench", "check-strategy", f"{BROKEN}:{cls}", "--models", models],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, (done.stdout + done.stderr).splitlines()


@pytest.mark.parametrize(
    "cls, rule, words",
    [
        ("Inflated", "against the full cache", "it claims exactness (claims_exact)"),
        ("NeverEvicts", "budget", "more than the 8 Window keeps there at budget=8"),
        ("FourTimes", "budget", "layer 0 holds 32 tokens"),
        ("Hoards", "budget", "holds 69,248 B after turn 1, more than the 8,320 B Window holds there at budget=8"),
        ("Unseeded", "determinism", "two runs of the same spec"),
        ("EditsKeys", "read-only step", "score() changed the step's keys in place at evicting layer 1"),
        ("HalfScores", "scores", "score() returned float16 scores"),
        ("Overflows", "scores", "candidates with +inf at evicting layer 1 of 4, at a prompt piece of 3 token(s)"),
        ("Slow", "time", "score() took 1.0"),
        ("MetaScores", "scores", "score() returned scores on meta"),
        (
            "BadFormula",
            "contract",
            "the run raised ZeroDivisionError: integer division or modulo by zero at turn 1's prompt",
        ),
    ],
)
def test_each_broken_strategy_fails_its_rule_in_one_line(cls, rule, words):
    """Exit 1, no traceback, every line a finding (or the total), and exactly one FAIL line: the rule's."""
    code, lines = _kit(cls)
    assert code == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    failed = [line for line in lines if line.startswith("FAIL")]
    assert [line.partition(" on ")[0] for line in failed] == [f"FAIL {rule}"], failed
    assert words in failed[0], failed
    assert all(line.startswith(("ok   ", "FAIL ")) for line in lines[:-2]) and lines[-2] == "", lines


def test_a_strategy_that_raises_fails_in_one_line_and_the_kit_goes_on():
    """An exception on the second turn: one contract line per model naming the step (the second turn's prompt), the
    rules judged on the first turn kept, and the next model checked."""
    code, lines = _kit("RaisesLater", "tiny-llama,tiny-gemma3")
    assert code == 1 and not any("Traceback" in line for line in lines), lines
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 2 and all(line.startswith("FAIL contract on ") for line in failed), failed
    assert all(
        "score() raised ValueError: no scores for a second prompt at evicting layer 1" in line and ", turn 2 " in line
        for line in failed
    ), failed
    assert any(line.startswith("ok   scores on tiny-gemma3") for line in lines), lines


def test_a_run_that_hangs_is_stopped_by_the_alarm_and_the_larger_models_are_not_tried(monkeypatch):
    """A score() that sleeps a minute, with the run's limit at 3 s: stopped inside that call with its measured time;
    the next model is not run (it would only take longer)."""
    monkeypatch.setattr(conformance, "RUN_SECONDS", 3.0)
    findings = conformance.check(f"{ROOT / BROKEN}:Hangs", ("tiny-llama", "tiny-gemma3"))
    failed = [f for f in findings if not f.ok]
    assert [(f.rule, f.model) for f in failed] == [("time", "tiny-llama"), ("time", "tiny-gemma3")], failed
    assert "a score() call that had run" in failed[0].words and "allowed: 3 s a run" in failed[0].words, failed
    assert failed[1].words == "not run: stopped for its time on tiny-llama"


def test_each_finding_is_said_as_it_is_judged():
    """`say` hears every finding, in order, before `check` returns (the command prints each at once)."""
    heard = []
    findings = conformance.check("window", ("tiny-llama",), say=heard.append)
    assert heard == findings and len(findings) >= 10
    assert not [f for f in findings if not f.ok], findings


def test_an_eviction_strategy_says_its_kv_comparison_does_not_apply():
    findings = conformance.check(f"{ROOT}/examples/random_eviction.py:RandomEviction", ("tiny-llama",))
    full = next(f for f in findings if f.rule == "against the full cache")
    assert full.ok and full.words.endswith("K/V exact: n/a (lossy)"), full


def test_the_family_is_the_packages_own_class_with_the_strategys_settings():
    """A subclass's bound is its nearest built-in's, built with its settings; a direct `Scored` subclass gets
    `Scored`'s (the budget on every global layer); the exact families have none."""
    from kvdirect_app.strategies import parse_spec
    from kvdirect_app.strategies.knorm import KNorm
    from kvdirect_app.strategies.scored import Scored

    fam = conformance.family(parse_spec(f"{ROOT / BROKEN}:FourTimes:budget=5"))
    assert type(fam).__name__ == "Window" and fam.budget == 5 and fam.layer_budgets(4, 100) == (5,)
    assert type(conformance.family(parse_spec(f"{ROOT / BROKEN}:Unseeded"))) is Scored
    knorm = conformance.family(parse_spec("knorm:skip=3:budget=7"))
    assert type(knorm) is KNorm and knorm.skip == 3 and knorm.budget == 7
    assert conformance.family(parse_spec("kvdirect")) is None and conformance.family(parse_spec("full")) is None
