#!/usr/bin/env bash
# Build the offline SGLang bundle: a site directory (import path) with SGLang 0.5.17, the Hopper
# (sm_90) part of sglang-kernel 0.4.5 and the pure-Python / ABI packages a server imports that a
# GPU image with torch 2.11 lacks (packages.txt), packed as one .tar.xz small enough to carry to a
# machine without internet (about 25 MiB). Run it where PyPI is reachable; no GPU needed.
#
#   bash scripts/sglang-bundle/build.sh [OUT] [WORKDIR]
#
# OUT      default .whl/sglang-site.tar.xz (what benchmarks/sglang_hicache_e2e.py, gpu-suite.sh and
#          device-disk-bench.sh look for)
# WORKDIR  where wheels are downloaded and unpacked (default: a temporary directory, removed)
# Target:  CPython 3.12 on x86_64 Linux (SGLANG_BUNDLE_PYTHON=3.11 etc. to change the version).
# Needs:   python3 with pip, unzip, xz, readelf and strip (binutils).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=$(realpath -m "${1:-$REPO/.whl/sglang-site.tar.xz}")
PYVER=${SGLANG_BUNDLE_PYTHON:-3.12}
if [ -n "${2:-}" ]; then
  WORK=$(realpath -m "$2"); mkdir -p "$WORK"
else
  WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
fi
for tool in unzip xz readelf strip; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is needed (apt install unzip xz-utils binutils)" >&2; exit 2; }
done

mapfile -t PKGS < <(grep -vE '^\s*(#|$)' "$HERE/packages.txt")
echo "== downloading ${#PKGS[@]} wheels for CPython $PYVER, manylinux x86_64"
# Every manylinux tag a glibc-2.34 x86_64 machine accepts, newest first.
PLATFORMS=()
for t in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
         manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLATFORMS+=(--platform "${t}_x86_64")
done
mkdir -p "$WORK/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PYVER" "${PLATFORMS[@]}" -d "$WORK/wheels" "${PKGS[@]}"

SITE=$WORK/site
rm -rf "$SITE" && mkdir -p "$SITE"
for w in "$WORK"/wheels/*.whl; do unzip -q -o "$w" -d "$SITE"; done
echo "== unpacked: $(du -sh "$SITE" | cut -f1)"

python3 "$HERE/patch_sglang.py" "$SITE"

echo "== pruning what a server on an H200 never loads"
# sglang-kernel: its loader picks sm90/ on compute capability 9.0; the Blackwell build and the
# optional attention libraries are left out.
rm -rf "$SITE/sgl_kernel/sm100"
rm -f "$SITE"/sgl_kernel/flash_ops.*.so "$SITE"/sgl_kernel/flashmla_ops.*.so \
      "$SITE"/sgl_kernel/infllm_ops.*.so
# sglang: the gRPC / multimodal Rust extensions (off unless asked for), the diffusion stack,
# benchmarks, and its test tree (except the package marker and the scripted runtime it imports).
rm -rf "$SITE/sglang/srt/server" "$SITE/sglang/multimodal_gen" "$SITE/sglang/benchmark"
rm -f "$SITE"/sglang/srt/grpc/_core.*.so "$SITE"/sglang/srt/multimodal/_core.*.so
find "$SITE/sglang/test" -mindepth 1 -maxdepth 1 ! -name __init__.py ! -name scripted_runtime \
  -exec rm -rf {} +
rm -rf "$SITE/sglang/srt/layers/attention/minimax_sparse_ops/tests" "$SITE/xgrammar/lib"
# test suites shipped inside dependencies
for d in dill/tests IPython/sphinxext/tests IPython/terminal/tests jsonschema/tests \
         jsonschema_specifications/tests referencing/tests traitlets/tests zmq/tests; do
  rm -rf "${SITE:?}/$d"
done
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
# debug sections of shared libraries
find "$SITE" -name '*.so*' -type f -print0 | while IFS= read -r -d '' so; do
  if readelf -S "$so" 2>/dev/null | grep -q '\.debug_info'; then strip --strip-debug "$so"; fi
done
echo "== pruned: $(du -sh "$SITE" | cut -f1)"

mkdir -p "$(dirname "$OUT")"
XZ_OPT="-9 -T$(nproc)" tar -cJf "$OUT.partial" -C "$SITE" .
mv "$OUT.partial" "$OUT"
python3 - "$OUT" <<'EOF'
import os, sys
print(f"== bundle {sys.argv[1]}: {os.path.getsize(sys.argv[1]) / 2**20:.1f} MiB")
EOF
