#!/usr/bin/env bash
# The disk-tier benchmarks (`vitrify bench disk`, `vitrify bench hicache`: no GPU needed) on another machine's
# drive, e.g. the GPU machine's local disk, so their ratios are measured on a second drive.
#
#   bash scripts/device-disk-bench.sh OUTDIR [TAG]
#
# Results: OUTDIR/disk-TAG-<date>.json and OUTDIR/hicache-TAG-<date>.json (TAG default: the
# host name). Needs vitrify importable (installs it from this tree when it is not).
# fio: from PATH, else from .whl/fio-bundle.tar.xz (Debian's fio plus the libraries it links;
# build it with `bash scripts/fio-bundle.sh` on a Debian/Ubuntu machine). SGLang (bench hicache):
# importable, else unpacked from .whl/sglang-site.tar.xz (build it with
# `bash scripts/sglang-bundle/build.sh`; see scripts/sglang-bundle/README.md). Both bundles are
# optional: what is missing is skipped with a line saying so and how to build it.
# VITRIFY_BENCH_QUICK=1 runs both with --quick; the exit code is that of the last benchmark that
# failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=$(realpath -m "${1:?usage: device-disk-bench.sh OUTDIR [TAG]}")
TAG=${2:-$(hostname -s)}
PY=${PYTHON:-python3}
SCRATCH=${VITRIFY_BENCH_DIR:-/tmp/vitrify-disk-bench}
WORK=$(mktemp -d)
mkdir -p "$OUTDIR" "$SCRATCH"
RC=0
QUICK=()
[ "${VITRIFY_BENCH_QUICK:-0}" = 1 ] && QUICK=(--quick)

if ! (cd /tmp && "$PY" -c "import vitrify.disk, vitrify.bench") 2>/dev/null; then
  echo "== installing vitrify from this tree"
  "$PY" -m pip install --no-build-isolation --no-deps --no-index -q . || exit 2
fi

. scripts/use-fio-bundle.sh

rename_result() {  # NAME: move WORK/NAME-<date>.json to OUTDIR/NAME-TAG-<date>.json
  for f in "$WORK/$1"-*.json; do
    [ -e "$f" ] || continue
    mv "$f" "$OUTDIR/$1-$TAG-${f##*/$1-}"
    echo "== wrote $OUTDIR/$1-$TAG-${f##*/$1-}"
  done
}

echo "== vitrify bench disk (scratch $SCRATCH)"
"$PY" -m vitrify bench disk --out "$WORK" --dir "$SCRATCH" "${QUICK[@]}" || RC=$?
rename_result disk

SGPATH=()
if ! "$PY" -c "import sglang" 2>/dev/null && [ -f .whl/sglang-site.tar.xz ]; then
  if [ ! -d /tmp/sgsite/sglang ]; then
    mkdir -p /tmp/sgsite && tar -xJf .whl/sglang-site.tar.xz -C /tmp/sgsite
  fi
  SGPATH=(env "PYTHONPATH=/tmp/sgsite${PYTHONPATH:+:$PYTHONPATH}" SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1)
fi
if "${SGPATH[@]}" "$PY" -c "import sglang.srt.mem_cache.hicache_storage" 2>/dev/null; then
  echo "== vitrify bench hicache (scratch $SCRATCH)"
  "${SGPATH[@]}" "$PY" -m vitrify bench hicache --out "$WORK" --dir "$SCRATCH" "${QUICK[@]}" || RC=$?
  rename_result hicache
else
  echo "== vitrify bench hicache skipped: sglang is not importable and no .whl/sglang-site.tar.xz was" \
       "carried (bash scripts/sglang-bundle/build.sh builds it)"
fi
rm -rf "$WORK" "$SCRATCH"
exit $RC
