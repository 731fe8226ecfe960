"""The installable package: `pip install .` in a clean virtualenv gives the library, `kvdirect-bench` and
`kvdirect-studio`, with the data files they need (no checkout on the path, no model download).

The install takes a few minutes (torch and gradio are unpacked from the package cache `make install` filled).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from kvdirect_app.schema import validate

ROOT = Path(__file__).resolve().parents[1]


def _requirements(path: Path) -> set[str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {re.sub(r"\s+", "", line) for line in lines if line}


def test_the_package_pins_what_requirements_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) == _requirements(ROOT / "requirements.txt")
    assert set(project["optional-dependencies"]["ray"]) == _requirements(ROOT / "requirements-ray.txt")
    assert set(project["optional-dependencies"]["dev"]) == _requirements(ROOT / "requirements-dev.txt")
    from kvdirect_app import __version__

    assert project["version"] == __version__


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    where = tmp_path_factory.mktemp("clean-venv")
    env_dir, source = where / "venv", where / "source"
    # The checkout's files as a clone has them (the build writes into its source tree: not into this one).
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build",
                                                                "*.egg-info", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    done = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(source)],
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-2000:]
    return env_dir, where


def _clean_env():
    """No checkout on the path: what an installed package sees (without the [dev] extra, so the suite validates
    what the clean install writes itself)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVDIRECT_VALIDATE_JSON")}


def test_kvdirect_bench_and_the_example_run_from_a_clean_install(venv):
    env_dir, cwd = venv
    env = _clean_env()
    bench = subprocess.run([str(env_dir / "bin" / "kvdirect-bench"), "run", "--model", "tiny-llama", "--strategies",
                            "full,kvdirect:budget=4", "--prompt", "hi", "--max-new-tokens", "4",
                            "--json", str(cwd / "run.json")],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr[-2000:]
    validate(json.loads((cwd / "run.json").read_text()))
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import kvdirect_app; print(kvdirect_app.__file__)"],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert str(env_dir) in where.stdout, where.stdout  # the installed copy, not the checkout
    example = subprocess.run([str(env_dir / "bin" / "python"), str(ROOT / "examples" / "generate_with_strategies.py")],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert example.returncode == 0, example.stderr[-2000:]
    assert "kvdirect:budget=8            same tokens 24/24" in example.stdout, example.stdout


def test_kvdirect_studio_serves_the_page_from_a_clean_install(venv):
    env_dir, cwd = venv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_clean_env(), "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    app = subprocess.Popen([str(env_dir / "bin" / "kvdirect-studio")], cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline, page = time.monotonic() + 240, None
        while time.monotonic() < deadline and app.poll() is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(1)
        assert page is not None, f"no page; exit {app.poll()}"
        assert "KV-Direct Studio" in page
    finally:
        app.terminate()
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
