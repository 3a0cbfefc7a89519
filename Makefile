# dflash2: one command sets up and runs the main job (`make demo`), one runs the tests (`make test`).
# Both create the environment when missing and are fast on the second run.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DFLASH2 := $(VENV)/bin/dflash2
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup models demo test test-all bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel (a bare `torch` pulls a multi-GB CUDA build); on a CUDA machine install the
# matching CUDA wheel of torch first and this step keeps it.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,serve,bench,grammar]"
	touch $(STAMP)

# the kernels compile here (one line each, ~3 min of one core, once) while the models download and convert (the
# download waits on the network, the compiler on a core), and one token generated writes the store's packed copy
# of the target (models/packed_cache.py), so the demo's first generation runs as fast as the next one
models: setup
	$(DFLASH2) kernels build & kernels=$$!; \
	$(DFLASH2) models pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct; pulled=$$?; \
	wait $$kernels && test $$pulled = 0
	$(DFLASH2) generate --max-new-tokens 1 "hi" >/dev/null

demo: models
	$(DFLASH2) generate "$(PROMPT)"

test: setup
	$(PY) -m pytest -m "not slow" -q --durations=25

test-all: setup
	$(PY) -m pytest -q

bench: models
	$(DFLASH2) bench --suite humaneval,gsm8k --limit 8 --drafters ngram,model

clean:
	rm -rf $(VENV) build src/*.egg-info
