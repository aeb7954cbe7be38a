# Sourced (`. scripts/use-fio-bundle.sh`) on a machine without fio: unpacks the carried
# .whl/fio-bundle.tar.xz (built by `bash scripts/fio-bundle.sh`) into /tmp/fio-bundle and puts a
# wrapper first on PATH, so the bundled libraries reach fio only. Says in one line which fio the
# caller gets, or that the fio baselines will be skipped.
if ! command -v fio >/dev/null 2>&1 && [ -f .whl/fio-bundle.tar.xz ]; then
  # optional: a failure here says so and leaves the caller running (even under set -e)
  if mkdir -p /tmp/fio-bundle/bin && tar -xJf .whl/fio-bundle.tar.xz -C /tmp/fio-bundle &&
     printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/fio-bundle/lib exec /tmp/fio-bundle/fio "$@"\n' \
       >/tmp/fio-bundle/bin/fio && chmod +x /tmp/fio-bundle/bin/fio; then
    if fio_err=$(/tmp/fio-bundle/bin/fio --version 2>&1); then
      export PATH="/tmp/fio-bundle/bin:$PATH"
    else  # e.g. built against a newer glibc than this machine's
      echo "== the carried fio bundle does not run here: $(echo "$fio_err" | head -1)"
    fi
    unset fio_err
  else
    echo "== cannot unpack .whl/fio-bundle.tar.xz into /tmp/fio-bundle"
  fi
fi
if command -v fio >/dev/null 2>&1; then
  echo "== fio: $(fio --version 2>&1)"
else
  echo "== fio: not on PATH and no .whl/fio-bundle.tar.xz (bash scripts/fio-bundle.sh builds it):" \
       "the fio baselines are skipped"
fi
