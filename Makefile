# Everything a fresh clone needs: `make demo` and `make test` create the
# virtualenv on first use (no root, only the package index), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv sglang-venv demo demo-tools demo-code test test-quick proto clean

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

# The code demo: the tiny policy learns from running its Python in the bubblewrap sandbox (recipes/tiny_code).
demo-code: venv
	$(PY) -m recipes.tiny_code.demo

# Unit-level tests: everything but the `stack` tests (service processes, Redis, SGLang, Prometheus, Ray)
# and the `slow` ones (process groups, compilers); tests/conftest.py marks both. They are independent and
# CPU-bound, so they run in two pytest-xdist workers (each worker takes ports from its own part of the range).
QUICK_TESTS := -m "not gpu and not docker and not stack and not slow" -n 2
# The whole suite (CI runs this): the stack and `serial` tests, the learning runs and sandbox tests, and every
# other test in three pytest processes at once, each with its slowest tests (tests/run_suite.sh says why).
test: venv sglang-venv
	PY=$(PY) bash tests/run_suite.sh

# The inner loop: the unit tests only.
test-quick: venv
	$(PY) -m pytest $(QUICK_TESTS) --durations=10 tests

proto: venv
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/lockstep.proto proto/rendezvous.proto

clean:
	rm -rf $(VENV) runs .pytest_cache
