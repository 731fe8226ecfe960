"""`bench reproduce`: a tiny-model report with every section, every number read back from results.json."""

import json
import re

import pytest

from kvdirect_app import bench
from kvdirect_app.claims import reproduce
from kvdirect_app.units import fmt_bytes

NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("claims")
    assert bench.main(["reproduce", "--model", "tiny-llama", "--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def allowed_numbers(results: dict) -> set[str]:
    """Every number a report may print: each value of results.json in each of the report's formats, and the
    numbers inside its strings (claims, names, settings)."""
    seen = set(NUMBER.findall(json.dumps(results)))

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            texts = [reproduce.number(x), fmt_bytes(x)]
            if isinstance(x, int):
                texts.append(f"{x:,}")
            for text in texts:
                seen.update(NUMBER.findall(text))

    walk(results)
    return seen


def test_every_section_is_in_the_report_with_a_verdict(report):
    out, results, text = report
    for name, title in reproduce.TITLES.items():
        assert title in text
        assert results["sections"][name]["verdict"] in ("holds", "holds with a caveat", "does not hold here")
        assert results["claims"][name]["claim"] in text
    for name in ("agreement", "recompute"):
        assert (out / f"{name}.html").stat().st_size > 1000 and (out / f"{name}.png").stat().st_size > 5000
    assert results["device_name"] in text and results["date"] in text


def test_every_number_in_the_report_comes_from_results_json(report):
    _, results, text = report
    allowed = allowed_numbers(results)
    stray = [n for n in NUMBER.findall(text) if n not in allowed]
    assert not stray, stray[:10]


def test_the_report_follows_results_json(report):
    """A mutation: change one measured value in results.json and the rendered report changes with it."""
    _, results, text = report
    changed = json.loads(json.dumps(results))
    changed["sections"]["replay"]["speedup"] = 987.654
    assert "988" in reproduce.render(changed) and "988" not in text


def test_bad_reproduce_input_is_one_line(capsys):
    assert bench.main(["reproduce", "--model", "no-such-model", "--out", "/tmp/x"]) == 2
    assert bench.main(["reproduce", "--model", "tiny-llama", "--executor", "dask", "--out", "/tmp/x"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "executor: unknown executor 'dask'; allowed: local, ray" in err
