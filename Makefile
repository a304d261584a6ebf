# Two commands set everything up from python3 and pip alone: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
KESTREL := $(VENV)/bin/kestrel
# The pinned CPU build of torch lies on these machines' disk; elsewhere pip takes it from PyPI.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP := $(PY) -m pip install --quiet --disable-pip-version-check $(FIND_LINKS)

.PHONY: serve test clean

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(PY)
	$(PIP) -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(PY)
	$(PIP) -e '.[test]'
	touch $@ $(VENV)/.runtime

# Serves the bundled model, models/k3.1-tiny, on 127.0.0.1:8000.
serve: $(VENV)/.runtime
	$(KESTREL) serve

# The cookbook page is tested in a real headless browser (Debian's chromium, installed when missing). Each test
# runs on one torch thread (tests/conftest.py), so two workers use both cores: 240-312 s on 2 cores against 508-570
# s in one process.
test: $(VENV)/.test
	sh tools/install_browser.sh
	$(PY) -m pytest -q -n 2

clean:
	rm -rf $(VENV) .cache
