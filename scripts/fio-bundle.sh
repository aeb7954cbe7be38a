#!/usr/bin/env bash
# Build .whl/fio-bundle.tar.xz: Debian's fio binary plus the shared libraries it links (glibc
# excepted), for a machine that has no fio and no package index. scripts/device-disk-bench.sh
# unpacks it there and runs fio with LD_LIBRARY_PATH pointing at the bundled lib/ only.
#
#   bash scripts/fio-bundle.sh [OUT]          (default: .whl/fio-bundle.tar.xz)
#
# Needs a Debian/Ubuntu machine with a package index (apt-get download needs no root) on which
# fio's libraries are installed (`apt-get install fio` installs them). The C library itself is
# not bundled: the target uses its own, and the script prints the newest glibc symbol version
# the bundle needs, to compare with `ldd --version` there.
# Layout of the archive: fio (the binary), lib/ (its libraries), VERSION (fio --version).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$REPO/.whl/fio-bundle.tar.xz}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for tool in apt-get dpkg-deb ldd objdump xz; do
  command -v "$tool" >/dev/null || { echo "fio-bundle: $tool is needed" >&2; exit 2; }
done

echo "== apt-get download fio"
if ! (cd "$WORK" && apt-get download -q fio) >"$WORK/apt.log" 2>&1; then
  cat "$WORK/apt.log" >&2
  echo "fio-bundle: apt-get download fio failed (run apt-get update first?)" >&2
  exit 2
fi
deb=$(ls "$WORK"/fio_*.deb)
dpkg-deb -x "$deb" "$WORK/root"
STAGE=$WORK/stage
mkdir -p "$STAGE/lib"
cp "$WORK/root/usr/bin/fio" "$STAGE/fio"
echo "== $(basename "$deb")"

# Libraries the binary loads, by the loader's own resolution; glibc's libraries stay behind.
missing=$(ldd "$STAGE/fio" | awk '/not found/ {print $1}')
if [ -n "$missing" ]; then
  echo "fio-bundle: libraries fio needs are not installed here: $(echo "$missing" | tr '\n' ' ')" >&2
  echo "            install them with: apt-get install fio" >&2
  exit 2
fi
GLIBC_LIBS='^(linux-vdso|ld-linux[^ ]*|libc|libm|libdl|libpthread|librt|libresolv|libutil)\.so'
ldd "$STAGE/fio" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
  if [[ $name =~ $GLIBC_LIBS ]]; then continue; fi
  cp -L "$path" "$STAGE/lib/$name"
done
echo "== $(ls "$STAGE/lib" | wc -l) libraries bundled ($(du -sh "$STAGE/lib" | cut -f1))"

# The bundle must run on its own: only lib/ on the library path, a real job on a scratch file.
version=$(LD_LIBRARY_PATH="$STAGE/lib" "$STAGE/fio" --version)
echo "$version" > "$STAGE/VERSION"
LD_LIBRARY_PATH="$STAGE/lib" "$STAGE/fio" --name=bundle-check --filename="$WORK/check.dat" \
  --size=8M --bs=64k --rw=write --ioengine=psync --output-format=terse >/dev/null
rm -f "$WORK/check.dat"
need=$(objdump -T "$STAGE/fio" "$STAGE"/lib/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
echo "== $version runs from the bundle; it needs glibc >= ${need#GLIBC_} on the target"

mkdir -p "$(dirname "$OUT")"
XZ_OPT="-9 -T$(nproc)" tar -cJf "$OUT.partial" -C "$STAGE" .
mv "$OUT.partial" "$OUT"
echo "== bundle $OUT: $(du -h "$OUT" | cut -f1)"
