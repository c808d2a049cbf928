#!/usr/bin/env bash
# Set up (same as the demo), lint and format check (ruff), then the whole test suite, multi-peer tests included.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline WANDB_SILENT=true
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# 4 test processes on 2 cores: most multi-peer tests wait on sockets, timers and peers far more than they compute.
# Whole files go to one process (--dist loadfile), the longest first (tests/conftest.py); `-n 0` runs in one process.
exec .venv/bin/python -m pytest tests -n 4 --dist loadfile "$@"
