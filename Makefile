# llama-radix-proxy: `make run` serves, `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint unit integration native model venv clean-cache help browser nginx valkey grafana-schema

help:
	@echo "make run    build what is missing (patched llama-server, default model) and serve the proxy"
	@echo "make test   lint (ruff check and format, mypy strict) and the whole test suite against real llama-server processes"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,workbench,dashboard]'
	@touch $(STAMP)

venv: $(STAMP)

# Order matters on a cold cache: the variants share one build tree, and stock -> patched
# -> fault-injection recompiles the least when switching.
native: $(STAMP)
	$(BIN)/radixctl build --variant stock
	$(BIN)/radixctl build
	$(BIN)/radixctl build --fault-injection

model: $(STAMP)
	$(BIN)/radixctl model path

# The workbench page test drives Debian's chromium with selenium: installed here when missing
# (as root, with apt-get); elsewhere the test says it skipped and why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } || \
	echo "skip: chromium not installed (the workbench page test will skip)"

# The multi-proxy test runs nginx in front of two proxies (deploy/nginx): installed here when
# missing (as root, with apt-get); elsewhere those tests say they skipped and why.
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light; } || \
	echo "skip: nginx not installed (the multi-proxy tests will skip)"

# The remote-tier test (docs/scale-out.md) runs a real Valkey, or Redis where the distribution
# has no valkey-server (Debian 12 ships redis-server 7.0; same protocol): installed here when
# missing (as root, with apt-get); elsewhere those tests say they skipped and why.
valkey:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q valkey-server || \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }; } || \
	echo "skip: neither valkey-server nor redis-server installed (the remote-tier tests will skip)"

# The Grafana dashboard schema of the version deploy/docker-compose.yml pins, from the npm
# registry (deploy/grafana/schema/install.sh: pinned and hashed, installed once under the cache),
# for tests/unit/test_grafana_dashboard.py; that test runs the same install itself. Prints a
# "skip:" line where node or npm is missing (the test then says it skipped and why).
grafana-schema:
	@deploy/grafana/schema/install.sh >/dev/null; rc=$$?; [ $$rc = 0 ] || [ $$rc = 3 ]

run: $(STAMP)
	$(BIN)/radixctl up

lint: $(STAMP)
	$(BIN)/ruff check proxy tests deploy
	$(BIN)/ruff format --check proxy tests deploy
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -m unit -q

integration: native model browser nginx valkey
	$(BIN)/python -m pytest -m integration

test: lint native model browser nginx valkey grafana-schema
	$(BIN)/python -m pytest

clean-cache:
	rm -rf $${RADIX_CACHE_DIR:-$$HOME/.cache/llama-radix-proxy}

# Not part of `make test`: the install, build, model fetch and unit tests on Debian 12
# (python3 3.11.2, the oldest supported) and Debian 13 (3.13) in containers made with
# debootstrap. About 25 min on 2 cores; QUICK=1 skips the llama.cpp compile (a few min).
# Prints a "skip:" line and succeeds where no container engine is reachable.
.PHONY: portability
portability:
	QUICK=$(QUICK) deploy/portability/check.sh $(SUITES)

# Not part of `make test`: the docker compose stack (deploy/) built from a local Debian base
# and run with host networking: health, chat through the proxy with cache reuse, Prometheus
# and every dashboard query, the workbench container's scenarios, a clean stop (docs/deploy.md). About 10 min on 2 cores when the
# llama.cpp compile is not cached yet. Prints a "skip:" line and succeeds where no container
# engine is reachable.
.PHONY: deploy-test
deploy-test: $(STAMP)
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dashboard]' || \
	echo "skip: matplotlib not installed (pip install -e '.[dashboard]'): no panel pictures"
	deploy/test/run.sh

# Not part of `make test`: the compose stack's fleet profile (two proxies, a server each, the
# valkey service as their shared remote tier) built from the local Debian base and run with host
# networking: a prompt prefilled behind proxy 1 is restored from the store behind proxy 2 (route
# H), the same answer, a clean stop (docs/scale-out.md, "Deploy"). Prints a "skip:" line and
# succeeds where no container engine is reachable.
.PHONY: deploy-fleet-test
deploy-fleet-test: $(STAMP)
	deploy/test/fleet.sh

# Not part of `make test`: KV in device memory (issue 26, docs/devices.md). The KV-move tests
# (tests/integration/test_vulkan.py) against llama-server built with ggml's Vulkan backend,
# patched and stock, every layer and the KV cache offloaded (-ngl 99), on Mesa's lavapipe (a
# CPU Vulkan device), so it runs on a machine with no GPU. vulkan-deps installs Debian's Vulkan
# build packages and lavapipe when missing (as root, with apt-get; about 25 MB), and where the
# system's Vulkan headers are too old for the pinned llama.cpp (Debian 12) Debian 13's headers
# under the cache (native/vulkan/fetch-headers.sh). Measured on this 2-core machine shared with
# other work (load average 4 to 8): the two Vulkan builds 41 min when not cached (about 2,000
# CPU-seconds, mostly the shaders and ggml-vulkan.cpp), the tests about 30 min (lavapipe decodes
# the default model at 2 to 4 s a token). Prints a "skip:" line and succeeds where the packages
# cannot be installed.
VULKAN_DEBIAN_PACKAGES := libvulkan-dev glslc spirv-headers mesa-vulkan-drivers
.PHONY: vulkan-deps vulkan-native vulkan-test
vulkan-deps:
	@{ command -v glslc >/dev/null && test -f /usr/include/vulkan/vulkan.hpp && \
	  test -d /usr/share/cmake/SPIRV-Headers && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; } || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(VULKAN_DEBIAN_PACKAGES); } || \
	echo "skip: the Vulkan build packages are not installed ($(VULKAN_DEBIAN_PACKAGES))"
	@native/vulkan/fetch-headers.sh

# Order as in `native`: stock, then patched recompiles only the server objects.
vulkan-native: vulkan-deps $(STAMP)
	$(BIN)/radixctl build --backend vulkan --variant stock
	$(BIN)/radixctl build --backend vulkan

vulkan-test: vulkan-deps $(STAMP) model
	@if command -v glslc >/dev/null && test -f /usr/include/vulkan/vulkan.hpp; then \
	  $(MAKE) vulkan-native && RADIX_TEST_VULKAN=1 $(BIN)/python -m pytest tests/integration/test_vulkan.py; \
	else echo "skip: no Vulkan build packages (make vulkan-deps), the Vulkan tests did not run"; fi

# Not part of `make test`: the patch series compiled against ggml's CUDA backend and the CUDA
# toolkit found here (nvcc; no GPU needed), for one GPU architecture (CUDA_CHECK_ARCH, default
# 90-real: H100/H200 machine code only, no PTX) and without the flash attention kernels' device
# code (GGML_CUDA_FA=OFF; CUDA_CHECK_FA=ON compiles them too). By default only the object files
# of the sources the series changes (radixctl build --objects-only, configured for CUDA: minutes,
# and it fails on a compile error in the patch); CUDA_CHECK_FULL=1 compiles every source and
# links the server (hours on 2 cores: ggml's CUDA kernels; 192 s on a 16-core GPU machine,
# docs/devices.md). Cached by content like every build (its own build tree). Where the toolkit
# lacks cuBLAS (PyPI's nvidia-cuda-nvcc, as here) the build fetches PyPI's nvidia-cublas wheel
# (420 MB) into the cache; with no GPU driver it builds without ggml's VMM pool. Prints a "skip:"
# line and succeeds where there is no nvcc. On a machine with an NVIDIA GPU, deploy/gpu/check.sh
# builds the full CUDA variant, runs the device KV-move tests and the benches.
CUDA_CHECK_ARCH ?= 90-real
CUDA_CHECK_FA ?= OFF
CUDA_CHECK_FULL ?= 0
CUDA_CHECK_ARGS = --backend cuda --cmake-arg -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_CHECK_ARCH) --cmake-arg -DGGML_CUDA_FA=$(CUDA_CHECK_FA)
.PHONY: cuda-check
cuda-check: $(STAMP)
	@if ! command -v nvcc >/dev/null; then echo "skip: no nvcc (CUDA toolkit), the CUDA compile check did not run"; \
	elif [ "$(CUDA_CHECK_FULL)" = 1 ]; then \
	  bin=$$($(BIN)/radixctl build $(CUDA_CHECK_ARGS)) || exit 1; \
	  if $$bin --help 2>&1 | grep -q -- --kvctl; then \
	    echo "cuda-check: $$bin (patched, CUDA, CMAKE_CUDA_ARCHITECTURES=$(CUDA_CHECK_ARCH)) compiled, linked and runs --help"; \
	  else echo "cuda-check: $$bin --help does not list --kvctl (run it to see why)"; exit 1; fi; \
	else \
	  objs=$$($(BIN)/radixctl build $(CUDA_CHECK_ARGS) --objects-only) || exit 1; \
	  echo "cuda-check: the sources the patch series changes compiled for CUDA ($(CUDA_CHECK_ARCH)), not linked:"; \
	  echo "$$objs" | sed 's/^/  /'; \
	fi

# Not part of `make test`: ARM64 (the seed's Kunpeng 920 deployment). The patched and stock
# llama-server cross-built for aarch64 with Debian's cross toolchain (radixctl build --cross
# aarch64, ARMv8.2-A+dotprod+fp16), then the /kvctl round trips of tests/integration/test_kvctl.py
# against them under qemu-aarch64-static (tests/integration/test_arm64.py). arm64-deps installs
# the packages when missing (as root, with apt-get). Times: docs/devices.md. Prints a "skip:"
# line and succeeds where the packages cannot be installed.
ARM64_DEBIAN_PACKAGES := gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static
.PHONY: arm64-deps arm64-native arm64-check
arm64-deps:
	@{ command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null; } || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(ARM64_DEBIAN_PACKAGES); } || \
	echo "skip: the aarch64 cross toolchain and qemu are not installed ($(ARM64_DEBIAN_PACKAGES))"

# Order as in `native`: stock, then patched recompiles only the server objects.
arm64-native: arm64-deps $(STAMP)
	$(BIN)/radixctl build --cross aarch64 --variant stock
	$(BIN)/radixctl build --cross aarch64

arm64-check: arm64-deps $(STAMP) model
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null; then \
	  $(MAKE) arm64-native && RADIX_TEST_ARM64=1 $(BIN)/python -m pytest tests/integration/test_arm64.py; \
	else echo "skip: no aarch64 cross toolchain or qemu (make arm64-deps), the arm64 tests did not run"; fi

# Not part of `make test`: the compose stack's llama-server and proxy images for linux/arm64
# (compose.arm64.yml), built from local Debian 12 bases (amd64 build stage that cross-compiles
# the server, arm64 runtime under qemu-user) and run: health checks, aarch64 containers, two
# chat requests through the proxy, the second reusing the first's KV (deploy/test/arm64.sh,
# docs/deploy.md "ARM64"). The host's cross build seeds the image build's cache.
.PHONY: arm64-images
arm64-images: arm64-deps $(STAMP)
	$(BIN)/radixctl build --cross aarch64
	SEED_FROM_HOST=1 deploy/test/arm64.sh
