# vitrify — the two commands a fresh machine needs:
#   make test   set everything up, build, run the C++ and Python tests
#   make demo   set everything up, then run vitrify's main job (see README)
VENV ?= .venv
PY := $(VENV)/bin/python
CPP_BUILD ?= build/cpp
JOBS ?= $(shell nproc)

.PHONY: all setup build build-python build-cpp test test-cpp test-python demo gpu-suite clean

all: build

setup: $(PY)
$(PY): scripts/setup.sh requirements-dev.txt requirements-sglang-test.txt
	bash scripts/setup.sh
	@touch $(PY)

build: build-python build-cpp

build-python: setup
	$(PY) -m pip install -q --no-build-isolation --no-deps .

build-cpp: setup
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DVITRIFY_BUILD_TESTS=ON -DVITRIFY_BUILD_BENCHMARKS=ON -DPython_EXECUTABLE=$(abspath $(PY))
	cmake --build $(CPP_BUILD) -j $(JOBS)

test-cpp: build-cpp
	cd $(CPP_BUILD) && ctest -LE gpu --output-on-failure -j $(JOBS)

test-python: build-python build-cpp
	VITRIFY_TEST_FAKE_LIBCUDA=$(abspath $(CPP_BUILD))/tests/cpp/libvitrify_fake_cuda.so \
	  $(PY) -m pytest

test: test-cpp test-python

demo: build-python
	$(VENV)/bin/vitrify demo

gpu-suite:
	bash scripts/gpu-suite.sh

clean:
	rm -rf build $(VENV)
