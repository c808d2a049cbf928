#!/usr/bin/env bash
# Set up (same as the demo), lint and format check (ruff), then the whole test suite, multi-peer tests included.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Whole files on 4 test processes (--dist loadfile, the files with the longest multi-peer tests first:
# tests/conftest.py): ~32 minutes for the whole suite on 2 cores instead of ~40-50 in one process. `-n 0` runs one
# process; `-m "not slow"` is the fast tier (~3 minutes).
exec .venv/bin/python -m pytest tests -n 4 --dist loadfile "$@"
