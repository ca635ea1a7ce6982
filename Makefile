# Everything a fresh clone needs: `make demo` and `make test` create the
# virtualenv on first use (no root, only the package index), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv sglang-venv demo demo-tools test test-quick proto clean

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# SGLang (CPU build for tests) lives in its own virtualenv: it pins a different
# torch than Lockstep's, and the rollout service only talks to it over HTTP.
sglang-venv:
	bash deploy/sglang/setup_cpu_venv.sh .venv-sglang

demo: venv
	$(PY) -m recipes.tiny_arith.demo

# The multi-turn demo: the tiny policy learns to call a calculator tool (recipes/tiny_tools).
demo-tools: venv
	$(PY) -m recipes.tiny_tools.demo

# The whole suite (CI runs this), then its 25 slowest tests.
test: venv sglang-venv
	$(PY) -m pytest -m "not gpu and not docker" --durations=25 tests

# The inner loop: unit-level tests only, without the `stack` tests (service processes, Redis, SGLang,
# Prometheus, Ray) and the `slow` ones (process groups, compilers); tests/conftest.py marks both.
test-quick: venv
	$(PY) -m pytest -m "not gpu and not docker and not stack and not slow" --durations=10 tests

proto: venv
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/lockstep.proto proto/rendezvous.proto

clean:
	rm -rf $(VENV) runs .pytest_cache
