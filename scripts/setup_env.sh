#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Python venv with the pinned requirements, and the offline data sets
# that come from Debian packages. Re-running it only does what changed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PYTHON_BIN=${PYTHON:-$(command -v python3.11 || command -v python3)}

log() { echo "[setup] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment with $PYTHON_BIN"
  "$PYTHON_BIN" -m venv "$VENV"
fi

wanted=$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)
if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$wanted" ]; then
  log "installing pinned requirements (first time: a few minutes)"
  "$VENV/bin/pip" install --disable-pip-version-check -q -r "$ROOT/requirements.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
  "$VENV/bin/python" -c "import hivemind, transformers, torch, timm, lightly" \
    || { log "error: the Python requirements did not install"; exit 1; }
  echo "$wanted" > "$VENV/.requirements.sha256"
fi
# The repository itself, editable: `common`, `albert`, `swav` and `template` import from any folder and script.
# Re-installed when the checkout moves, pyproject.toml changes or a top-level package is added.
layout=$( (echo "$ROOT"; cat "$ROOT/pyproject.toml"; cd "$ROOT" && ls -d */__init__.py) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VENV/.editable.sha256" 2>/dev/null)" != "$layout" ]; then
  log "installing this repository into the environment (editable)"
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$ROOT" >&2 \
    || { log "error: pip install -e . failed"; exit 1; }
  echo "$layout" > "$VENV/.editable.sha256"
fi

# Debian packages that carry real data: Fashion-MNIST (SwAV) and Bengali word lists (sahajBERT); a headless
# browser (chromium) that the dashboard's test opens the monitor's live page in.
debian_packages=(dataset-fashion-mnist hunspell-bn nftables iproute2 chromium)
missing=()
for package in "${debian_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian data packages: ${missing[*]}"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
      || log "warning: could not install ${missing[*]} (SwAV / sahajBERT data will be reported missing, the browser test skipped)"
  else
    log "warning: ${missing[*]} not installed and apt-get is not usable as this user (run: sudo apt-get install ${missing[*]})"
  fi
fi

for hook in "$ROOT"/scripts/setup.d/*.sh; do
  [ -e "$hook" ] && bash "$hook" "$VENV/bin/python"
done
log "environment ready: $VENV"
