# vitrify — the two commands a fresh machine needs:
#   make demo   set up only what the demo needs, build, run `vitrify demo` (see README)
#   make test   set up the test stack too, build, run the C++ and Python tests
VENV ?= .venv
PY := $(VENV)/bin/python
CPP_BUILD ?= build/cpp
JOBS ?= $(shell nproc)
# The Python extension is built against one interpreter, so each virtual environment gets its
# own incremental build directory (named by a checksum of the venv's absolute path): building
# from a second venv never reconfigures or rebuilds the first one's. A plain `pip install .`
# builds in a fresh temporary directory (pyproject.toml sets no build-dir).
VENV_KEY := $(firstword $(shell printf '%s' '$(abspath $(VENV))' | cksum))
PY_BUILD ?= build/py-$(VENV_KEY)
# setup.sh's stamps: the demo set-up is a subset of the test set-up
SETUP_DEMO := $(VENV)/.vitrify-setup-demo
SETUP_TEST := $(VENV)/.vitrify-setup-test

.PHONY: all setup setup-demo build build-python build-cpp test test-cpp test-python demo \
        gpu-suite clean

all: build

setup: $(SETUP_TEST)
setup-demo: $(SETUP_DEMO)
$(SETUP_DEMO): scripts/setup.sh requirements-build.txt
	bash scripts/setup.sh demo
	@touch $@
$(SETUP_TEST): scripts/setup.sh requirements-build.txt requirements-dev.txt \
               requirements-sglang-test.txt
	bash scripts/setup.sh test
	@touch $@ $(SETUP_DEMO)

build: build-python build-cpp

build-python: $(SETUP_DEMO)
	@echo "build-python: $(PY_BUILD) (this venv's build directory)"
	$(PY) -m pip install -q --no-build-isolation --no-deps \
	  --config-settings=build-dir=$(PY_BUILD) .

build-cpp: $(SETUP_TEST)
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DVITRIFY_BUILD_TESTS=ON -DVITRIFY_BUILD_BENCHMARKS=ON
	cmake --build $(CPP_BUILD) -j $(JOBS)

# Every C++ test runs; GPU tests skip without a driver (ctest lists them as "Not Run") and
# skip_reasons.awk prints why.
test-cpp: build-cpp
	cd $(CPP_BUILD) && { ctest --output-on-failure -j $(JOBS); rc=$$?; \
	  awk -f $(abspath tests/cpp/skip_reasons.awk) Testing/Temporary/LastTest.log; exit $$rc; }

test-python: $(SETUP_TEST) build-python build-cpp
	VITRIFY_TEST_FAKE_LIBCUDA=$(abspath $(CPP_BUILD))/tests/cpp/libvitrify_fake_cuda.so \
	  $(PY) -m pytest

test: test-cpp test-python

demo: build-python
	$(VENV)/bin/vitrify demo

gpu-suite:
	bash scripts/gpu-suite.sh

clean:
	rm -rf build $(VENV)
