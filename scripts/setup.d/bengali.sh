#!/usr/bin/env bash
# sahajBERT's offline Bengali stand-in sources (.cache/bengali/), built once from Debian packages + wordfreq.
set -uo pipefail
PY=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -d "$ROOT/.cache/bengali/oscar_standin" ] && [ -d "$ROOT/.cache/bengali/wikipedia_standin" ]; then
  exit 0
fi
echo "[setup] preparing offline Bengali data (.cache/bengali)" >&2
if ! (cd "$ROOT" && "$PY" scripts/prepare_bengali_data.py >/dev/null 2>&1); then
  # apt-get download needs current package lists
  if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; fi
  (cd "$ROOT" && "$PY" scripts/prepare_bengali_data.py >/dev/null) \
    || echo "[setup] warning: Bengali data could not be prepared (sahajBERT tiny runs will report it missing)" >&2
fi
exit 0
