PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-paper clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt.py

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

$(VENV)/.bench-installed: $(STAMP)
	$(PY) -m pip install -e ".[test,bench]"
	touch $(VENV)/.bench-installed

bench-paper: $(STAMP) $(VENV)/.bench-installed
	$(PY) benchmarks/fidelity.py
	$(PY) benchmarks/paper.py

clean:
	rm -rf $(VENV)
