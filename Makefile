# Two commands set everything up from python3 and pip alone: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
KESTREL := $(VENV)/bin/kestrel
# The pinned CPU build of torch lies on these machines' disk; elsewhere it comes from PyPI.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# pip installs uv, and uv the rest: ~35 s from a fresh clone on 2 cores against pip's ~100 s. Bytecode is compiled
# at install (on every core), since these machines write none at run time (PYTHONDONTWRITEBYTECODE=1).
UV := $(VENV)/bin/uv
INSTALL := $(UV) pip install --quiet --python $(PY) --compile-bytecode $(FIND_LINKS)

.PHONY: serve test check-recipes clean

$(PY):
	python3 -m venv $(VENV)

$(UV): | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.10

$(VENV)/.runtime: pyproject.toml | $(UV)
	$(INSTALL) -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(UV)
	$(INSTALL) -e '.[test]'
	touch $@ $(VENV)/.runtime

# Serves the bundled model, models/k3.1-tiny, on 127.0.0.1:8000.
serve: $(VENV)/.runtime
	$(KESTREL) serve

# kestrel's CPU kernels are built once before the tests (~25 s on 2 cores), not by every test process
# that needs them at once. The cookbook page is tested in a real headless browser (Debian's chromium, installed
# when missing). Each test runs on one torch thread (tests/conftest.py), so two workers use both cores: 240-312 s
# on 2 cores against 508-570 s in one process when measured on AVX-512 (~500 s with two workers on a 2-core AVX2
# EPYC, December 2026).
test: $(VENV)/.test
	sh tools/install_browser.sh
	$(PY) -c "import kestrel.ops.cpu as cpu; cpu.load()"
	$(PY) -m pytest -q -n 2

# Parses every SGLang, vLLM and SGLang-router command the cookbook emits with the engines' own argument parsers
# (SGLang 0.5.23, vLLM 0.34.0 and sglang-router 0.3.2 from PyPI, --no-deps, in .cache/upstream-venv: about 100 s to
# build the first time; the parse about 40 s) and records the result in tests/cookbook/golden/upstream_check.json,
# which the golden-file test checks. Run it after every change to tests/cookbook/golden/recipes.txt.
check-recipes: $(VENV)/.runtime
	$(PY) tools/check_upstream_parsers.py $(FIND_LINKS)

clean:
	rm -rf $(VENV) .cache
