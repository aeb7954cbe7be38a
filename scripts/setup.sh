#!/usr/bin/env bash
# Prepare a fresh Linux machine for vitrify (no GPU needed): system packages (apt, when run as
# root or with sudo), then a virtual environment in .venv.
#
#   bash scripts/setup.sh [demo|test]      (default: test)
#
# demo  what building vitrify and running `vitrify demo` need, nothing more: cmake, ninja, g++
#       from apt; scikit-build-core and nanobind from PyPI (requirements-build.txt).
# test  everything for `make test` on top: GoogleTest, Google Benchmark and fio from apt; pytest,
#       hypothesis, numpy, ... (requirements-dev.txt); the pinned SGLang test environment
#       (requirements-sglang-test.txt, with CPU torch) and the second supported SGLang release
#       beside it in $VENV/sglang-<version> (its wheel only); VITRIFY_SGLANG_TESTS=0 leaves
#       both out.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-test}
case "$MODE" in
  demo | test) ;;
  *) echo "setup: unknown mode '$MODE' (use demo or test)" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
APT_PKGS=(cmake ninja-build g++)
[ "$MODE" = test ] && APT_PKGS+=(libgtest-dev libbenchmark-dev fio)

need_apt=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "setup: missing system packages ${need_apt[*]} and no root/sudo to install them" >&2
    exit 1
  fi
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

cuda_h=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  [ -n "$d" ] && [ -f "$d/include/cudaTypedefs.h" ] && cuda_h="$d/include" && break
done
if [ -z "$cuda_h" ] && command -v nvcc >/dev/null; then
  d=$(dirname "$(dirname "$(command -v nvcc)")")
  [ -f "$d/include/cudaTypedefs.h" ] && cuda_h="$d/include"
fi
if [ -z "$cuda_h" ]; then
  echo "setup: CUDA headers are needed to build vitrify (cuda.h, cudaTypedefs.h, CUPTI's" >&2
  echo "       cupti_callbacks.h and the runtime type headers they include, crt/ among them);" >&2
  echo "       install a CUDA toolkit >= 12.4 (no GPU needed) or set CUDA_HOME" >&2
  exit 1
fi
echo "setup: CUDA headers in $cuda_h"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ "$MODE" = demo ]; then
  "$VENV/bin/python" -m pip install -q -r requirements-build.txt
  echo "setup: done (demo: build requirements only; make test adds the test stack)"
  exit 0
fi
"$VENV/bin/python" -m pip install -q -r requirements-dev.txt

# SGLang for the `sglang`-marked tests (list and reasons: requirements-sglang-test.txt).
# VITRIFY_SGLANG_TESTS=0 skips it (those tests then skip, saying sglang is not installed).
if [ "${VITRIFY_SGLANG_TESTS:-1}" != 0 ]; then
  echo "setup: SGLang test environment (requirements-sglang-test.txt; VITRIFY_SGLANG_TESTS=0 skips)"
  sg_pin=$(grep -E '^sglang==' requirements-sglang-test.txt)
  grep -vE '^sglang==' requirements-sglang-test.txt > "$VENV/sglang-deps.txt"
  # pip's resolver lists sglang's GPU requirements as missing: expected, they are left out.
  log="$VENV/sglang-pip.log"
  if ! { "$VENV/bin/python" -m pip install -q -r "$VENV/sglang-deps.txt" &&
         "$VENV/bin/python" -m pip install -q --no-deps "$sg_pin"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: installing the SGLang test environment failed (VITRIFY_SGLANG_TESTS=0 skips it)" >&2
    exit 1
  fi
  grep -vE "^sglang [0-9.]+ requires|dependency resolver|is ignored: it is neither" "$log" || true

  # The second release (requirements-sglang-test.txt's "second release:" line): its wheel alone
  # in its own directory, which tests/python/test_sglang_versions.py puts first on sys.path.
  sg2_pin=$(sed -nE 's/^# *second release: *(sglang==[0-9][0-9.]*) *$/\1/p' requirements-sglang-test.txt)
  if [ -z "$sg2_pin" ]; then
    echo "setup: requirements-sglang-test.txt has no '# second release: sglang==X' line" >&2
    exit 1
  fi
  sg2_version=${sg2_pin#sglang==}
  sg2_dir="$VENV/sglang-$sg2_version"
  if [ ! -d "$sg2_dir/sglang-$sg2_version.dist-info" ]; then
    echo "setup: SGLang $sg2_version for the plugin's second-release tests ($sg2_dir, --no-deps)"
    rm -rf "$sg2_dir"
    if ! "$VENV/bin/python" -m pip install -q --no-deps --target "$sg2_dir" "$sg2_pin" \
           >"$VENV/sglang-$sg2_version-pip.log" 2>&1; then
      cat "$VENV/sglang-$sg2_version-pip.log" >&2
      rm -rf "$sg2_dir"
      echo "setup: installing SGLang $sg2_version into $sg2_dir failed (VITRIFY_SGLANG_TESTS=0 skips it)" >&2
      exit 1
    fi
  fi
fi
echo "setup: done"
